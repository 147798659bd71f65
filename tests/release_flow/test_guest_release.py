"""A hostile package through a whole release with Trusted Publishing: the worker holds an OIDC identity (GitHub
Actions' token service, a loopback stand-in) and the step's other secrets. Its build (setup.py), its build
requirement (an sdist: its hook when installed, its module when imported), conftest and tests try to read them, the user's files and Kiln's homes, to write Kiln's state, and to reach listeners outside
their sandbox, the identity's token service and the minting endpoint among them. Nothing succeeds; the upload
task alone uses the identity, once, and its minted token reaches the index (a real pypiserver) and nothing else."""

from __future__ import annotations

import json
import os
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.sandbox import support
from kiln.flows.release import approved_release_flow
from tests.helpers.gitrepo import FIXTURES, init_repo
from tests.helpers.hostile import SECRETS, Listener, helper_sdist, own_address
from tests.helpers.loopback_oidc import loopback_github_oidc_stand_in, loopback_mint_token_stand_in
from tests.helpers.loopback_pypi import pypi_server

MINTED = "pypi-minted-for-the-upload-task-only"
BEARER = "actions-request-bearer-of-the-worker"


def _hostile(tmp_path: Path, upload_url: str, index_url: str, oidc_url: str, targets: dict[str, list[Any]]) -> Path:
    """The hostile fixture with a PyPI target by Trusted Publishing and a hostile build requirement (an sdist by file,
    whose hook tries ``targets`` when installed)."""
    repo = tmp_path / "hostile"
    shutil.copytree(FIXTURES / "hostile", repo, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = repo / "pyproject.toml"
    requirement = f'"hostile-helper @ {helper_sdist(tmp_path / "helper-dist", targets).as_uri()}"'
    pyproject.write_text(pyproject.read_text().replace('requires = ["setuptools>=61"]',
                                                       f'requires = ["setuptools>=61", {requirement}]'))
    assert "hostile-helper @" in pyproject.read_text(), "the hostile fixture's build-system changed"
    config = repo / "kiln.toml"
    config.write_text(config.read_text() + "\n".join([
        "", "[publish.targets.pypi]", 'kind = "upload"', f'url = "{upload_url}"', f'index_url = "{index_url}"',
        'pypi_variant = "cpu"', "trusted_publishing = true", f'oidc_url = "{oidc_url}"', ""]))
    init_repo(repo)
    return config


def _address(url: str) -> list[str | int]:
    parts = urlsplit(url)
    return [str(parts.hostname), int(parts.port or 80)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a whole release (build, tests, bench, publish, upload) on a busy 2-core machine
@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="this kernel allows no Landlock or no user namespaces: package code is not confined")
def test_a_hostile_packages_release_with_trusted_publishing_shows_its_code_no_identity_and_uploads(
        prefect_server, tmp_path, monkeypatch):
    for name, value in SECRETS.items():  # the worker's other secrets; its identity is the stand-in's below
        if not name.startswith("ACTIONS_ID_TOKEN_REQUEST_"):
            monkeypatch.setenv(name, value)
    canary = tmp_path / "credentials"
    canary.write_text("[default]\naws_secret_access_key = canary\n")
    listeners = [Listener(), Listener(own_address())]
    out = tmp_path / "out"
    out.mkdir()
    targets: dict[str, list[Any]] = {
        "read": [str(canary), str(Path.home()), str(out), os.environ.get("PREFECT_HOME", str(Path.home()))],
        "write": [str(out), str(tmp_path / "hostile" / ".kiln"), str(tmp_path)]}
    try:
        with loopback_github_oidc_stand_in(monkeypatch, BEARER) as identity, \
                loopback_mint_token_stand_in(MINTED, trusted=identity) as mint, \
                pypi_server(tmp_path / "pypiserver", token=MINTED) as server:
            services = [_address(os.environ["ACTIONS_ID_TOKEN_REQUEST_URL"]), _address(mint.url)]
            for host, port in [(x.host, x.port) for x in listeners] + [(str(h), int(p)) for h, p in services]:
                socket.create_connection((host, port), timeout=5).close()  # each answers outside the sandbox
            targets |= {"listeners": [[x.host, x.port] for x in listeners] + services}
            config = _hostile(tmp_path, server.url, server.index_url, mint.url, targets)
            monkeypatch.setenv("HOSTILE_TARGETS", json.dumps(targets))
            monkeypatch.setenv("HOSTILE_ALLOWED", "yes")
            state = approved_release_flow(version="0.1.0", config_path=str(config), out=str(out), return_state=True)
            assert state.is_completed(), state.message
            assert mint.received == [identity]  # the upload task's one exchange: nothing else fetched it
            assert sorted(p.name for p in server.packages.iterdir()) == ["hostile-0.1.0-py3-none-any.whl"]
    finally:
        for listener in listeners:
            listener.close()
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert units["test/unit/cpu"].message.startswith("3 passed"), units["test/unit/cpu"].message
    wheels = [run.root / a.path for a in run.artifacts_of("wheel")]
    assert wheels
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            built = json.loads(archive.read("hostile/build_probe.json"))
        assert built["done"] == [] and {f"connect {h}:{p}" for h, p in services} <= set(built["tried"]), built
        # the build requirement: its sdist's hook, run by Kiln before the installer is given its wheel (no secret,
        # no file of the user's, no Kiln home, no network), and its module imported by the build (nothing either)
        installed, imported = built["requirement"]["installed"], built["requirement"]["imported"]
        assert installed["done"] == [] and imported["done"] == [], built["requirement"]
        assert {f"{how} {path}" for how in ("read", "write") for path in targets[how]} <= set(installed["tried"])
        reached = {f"connect {h}:{p}" for h, p in targets["listeners"]}
        assert reached <= set(installed["tried"]) and reached <= set(imported["tried"]), built["requirement"]
    assert [listener.accepted for listener in listeners] == [1, 1]  # only the direct checks above
    assert not list(out.glob(".hostile-*")) and not list(config.parent.glob(".hostile-*"))
    secrets = (MINTED, identity, BEARER)
    assert not [p for p in out.rglob("*") for s in secrets if p.is_file() and s.encode() in p.read_bytes()]
