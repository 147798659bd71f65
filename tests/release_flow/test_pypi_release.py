"""The release flow uploads its PyPI variant to a PyPI-compatible index (a real pypiserver on loopback).

The tiny project gains a ``kind = "upload"`` target whose API token is a Prefect
Secret block on the session's server; the release publishes Kiln's indexes,
then uploads the ``cpu`` variant's wheel under the public version; pip installs
it from the server; uploading the same run again sends nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prefect import flow

from kiln.flows.common import open_run
from kiln.flows.pypi import upload_release
from kiln.flows.release import approved_release_flow
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.loopback_pypi import PypiServer, pypi_server

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"
TOKEN = "pypi-loopback-token-never-logged"


def _project(tmp_path: Path, server: PypiServer, block: str) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    init_repo(root)
    config = root / "kiln.toml"
    text = config.read_text()
    cpu_only = text[:text.index("[[variants]]")] + text[text.index('[[variants]]\nname = "cpu"'):]  # less to build
    config.write_text(cpu_only + "\n".join([
        "", "[publish.targets.pypi]", 'kind = "upload"', f'url = "{server.url}"', f'index_url = "{server.index_url}"',
        'pypi_variant = "cpu"', f'token_block = "{block}"', ""]))
    commit_all(root, "upload the cpu variant to a PyPI-compatible index")
    return config


@flow
def upload_again(config_path: str, out: str, run_id: str) -> list[str]:
    config = load_config(config_path)
    run = open_run(config, "release", out, run_id=run_id)
    return [state.message or "" for state in upload_release(config, run, "0.3.0")]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a whole release (build, tests, bench, publish, verify) on a busy 2-core machine
def test_a_release_uploads_its_pypi_variant_under_the_public_version(prefect_server, tmp_path, caplog):
    from prefect.blocks.system import Secret

    block = f"kiln-pypi-{uuid.uuid4().hex[:8]}"
    Secret(value=TOKEN).save(block)
    with pypi_server(tmp_path / "pypiserver") as server:
        config = _project(tmp_path, server, block)
        out = tmp_path / "out"
        state = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), return_state=True)
        assert state.is_completed(), state.message
        assert sorted(p.name for p in server.packages.iterdir()) == ["tiny_kernels-0.3.0-py3-none-any.whl"]
        assert server.uploads() == 1

        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
             "--index-url", server.index_url, "--target", str(tmp_path / "site"), "tiny-kernels==0.3.0"],
            env=env, capture_output=True, text=True, timeout=300)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert (tmp_path / "site" / "tiny_kernels-0.3.0.dist-info").is_dir()

        run_id = next(p.name for p in out.iterdir() if (p / "run.json").is_file())
        assert upload_again(str(config), str(out), run_id) == ["upload to pypi: 0 files sent, 1 skipped"]
        assert server.uploads() == 1  # the re-run sent nothing
    assert TOKEN not in caplog.text
    assert not [p for p in out.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
