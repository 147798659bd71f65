"""The release's upload with Trusted Publishing: the upload task mints its token from the worker's OIDC
identity (the ``id`` library's GitHub Actions detection, its token service a loopback stand-in) at a loopback
stand-in for PyPI's minting endpoint, and twine sends it to a real pypiserver that takes that token only.
A worker with no identity is refused before the build."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from prefect import flow

from kiln.core import identity
from kiln.core.errors import ConfigError
from kiln.core.record import RunRecord
from kiln.flows.pypi import plan_uploads, upload_release
from kiln.flows.release import approved_release_flow
from kiln.release.upload.trusted_publishing import NoIdentityError
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.loopback_oidc import (
    loopback_github_oidc_stand_in,
    loopback_mint_token_stand_in,
    without_ambient_identity,
)
from tests.helpers.loopback_pypi import pypi_server
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"
MINTED = "pypi-minted-upload-token-never-logged"
BEARER = "actions-request-bearer-never-logged"


def _project(tmp_path: Path, upload_url: str, index_url: str, oidc_url: str, extra: str = "") -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    init_repo(root)
    config = root / "kiln.toml"
    text = config.read_text()
    cpu_only = text[:text.index("[[variants]]")] + text[text.index('[[variants]]\nname = "cpu"'):]
    config.write_text(cpu_only + "\n".join([
        "", "[publish.targets.pypi]", 'kind = "upload"', f'url = "{upload_url}"', f'index_url = "{index_url}"',
        'pypi_variant = "cpu"', "trusted_publishing = true", f'oidc_url = "{oidc_url}"', extra, ""]))
    commit_all(root, "upload the cpu variant with Trusted Publishing")
    return config


@flow
def plan_then_upload(config_path: str, run: RunRecord) -> list[tuple[str, str]]:
    # As the release flow holds it: the identity is out of the environment for the whole run, so the upload
    # below can mint only if its task is the one place it is exposed.
    with identity.kept():
        assert not [name for name in os.environ if identity.identity_name(name)]
        config = load_config(config_path)
        plan_uploads(config, run, "0.3.0")
        return [(state.type.value, state.message or "") for state in upload_release(config, run, "0.3.0")]


def test_the_upload_task_mints_a_token_that_reaches_twine_and_no_log_record_or_artifact(
        prefect_server, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with loopback_github_oidc_stand_in(monkeypatch, BEARER) as identity, \
            loopback_mint_token_stand_in(MINTED, trusted=identity) as mint, \
            pypi_server(tmp_path / "pypiserver", token=MINTED) as server:  # takes an upload with MINTED only
        config = _project(tmp_path, server.url, server.index_url, mint.url)
        out = tmp_path / "out"
        run = make_record(config, out, {})
        wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", "0.3.0+cpu", payload="the cpu build")
        run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")

        assert plan_then_upload(str(config), run) == [("COMPLETED", "upload to pypi: 1 files sent, 0 skipped")]
        assert server.uploads() == 1 and mint.received == [identity]  # twine sent the minted token
        assert sorted(p.name for p in server.packages.iterdir()) == ["tiny_kernels-0.3.0-py3-none-any.whl"]
    run.write_view()
    secrets = (MINTED, identity, BEARER)
    assert not [s for s in secrets if s in caplog.text]
    assert not [p for p in out.rglob("*") for s in secrets if p.is_file() and s.encode() in p.read_bytes()]
    assert not [s for s in secrets if s in str(run.info()) or s in str(run.units())]


def test_a_release_refuses_before_the_build_when_the_worker_has_no_identity(prefect_server, tmp_path, monkeypatch):
    without_ambient_identity(monkeypatch)
    with loopback_mint_token_stand_in(MINTED, trusted="none") as mint:
        config = _project(tmp_path, "http://127.0.0.1:9/", "http://127.0.0.1:9/simple/", mint.url)
        with pytest.raises(NoIdentityError, match="publish.targets.pypi.trusted_publishing: this worker has no OIDC"
                                                  " identity") as info:
            approved_release_flow(version="0.3.0", config_path=str(config), out=str(tmp_path / "out"))
    assert all(name in str(info.value) for name in ("GitHub Actions", "GitLab", "Google Cloud"))
    assert mint.received == []
    assert not (tmp_path / "out").exists() and not (config.parent / ".kiln").exists()  # nothing built or recorded


def test_a_target_with_a_token_block_and_trusted_publishing_is_refused_at_load(tmp_path):
    config = _project(tmp_path, "https://upload.example/legacy/", "https://example/simple/",
                      "https://example/", extra='token_block = "pypi-token"')
    with pytest.raises(ConfigError, match="token_block and trusted_publishing = true both set: choose one"):
        load_config(config)
