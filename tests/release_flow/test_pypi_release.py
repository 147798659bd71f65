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

from kiln.core.errors import ConfigError
from kiln.core.record import RunRecord
from kiln.flows.pypi import plan_uploads, upload_release
from kiln.flows.release import approved_release_flow
from kiln.flows.run.common import open_run
from kiln.release.upload.twine import Endpoint, IndexCredentials, send_file
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.loopback_pypi import PypiServer, pypi_server
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"
TOKEN = "pypi-loopback-token-never-logged"


def _project(tmp_path: Path, server: PypiServer, block: str | None) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    init_repo(root)
    config = root / "kiln.toml"
    text = config.read_text()
    cpu_only = text[:text.index("[[variants]]")] + text[text.index('[[variants]]\nname = "cpu"'):]  # less to build
    config.write_text(cpu_only + "\n".join([
        "", "[publish.targets.pypi]", 'kind = "upload"', f'url = "{server.url}"', f'index_url = "{server.index_url}"',
        'pypi_variant = "cpu"', f'token_block = "{block}"' if block else "", ""]))
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


@pytest.fixture
def server(tmp_path):
    with pypi_server(tmp_path / "pypiserver") as running:
        yield running


def test_a_real_release_without_a_token_is_refused_before_the_build(prefect_server, server, tmp_path):
    config = _project(tmp_path, server, None)
    with pytest.raises(ConfigError, match="publish.targets.pypi: no token_block names the Prefect Secret block"):
        approved_release_flow(version="0.3.0", config_path=str(config), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (config.parent / ".kiln").exists()  # nothing built or recorded


def _run_with_cpu_wheels(config: Path, out: Path, payloads: dict[str, str]) -> RunRecord:
    """A release run as its build leaves it: one ``0.3.0+cpu`` wheel per tag, with the given payloads."""
    run = make_record(config, out, {})
    for tag, payload in payloads.items():
        wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", "0.3.0+cpu", tag=tag, payload=payload)
        run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    return run


@flow
def plan_then_upload(config_path: str, run: RunRecord) -> tuple[list[str], list[tuple[str, str]]]:
    config = load_config(config_path)
    _, refusals = plan_uploads(config, run, "0.3.0")
    states = upload_release(config, run, "0.3.0")
    return refusals, [(state.type.value, state.message or "") for state in states]


def test_a_refused_file_fails_its_own_unit_and_the_other_files_still_go_up(prefect_server, server, tmp_path):
    from prefect.blocks.system import Secret

    block = f"kiln-pypi-{uuid.uuid4().hex[:8]}"
    Secret(value=TOKEN).save(block)
    config = _project(tmp_path, server, block)
    tags = {"py3-none-any": "this build", "py3-none-manylinux_2_28_x86_64": "this build too"}
    run = _run_with_cpu_wheels(config, tmp_path / "out", tags)
    taken = make_wheel(tmp_path / "elsewhere", "tiny-kernels", "0.3.0", payload="someone else's bytes")
    send_file(taken, Endpoint("pypi", server.url, server.index_url), IndexCredentials("kiln", TOKEN))

    refusals, states = plan_then_upload(str(config), run)
    assert len(refusals) == 1 and "tiny_kernels-0.3.0-py3-none-any.whl is already on the index with sha256" in (
        refusals[0])  # what the approver reads: the release would stop here, before anything moves
    [(state, message)] = states
    assert state == "FAILED" and "tiny_kernels-0.3.0-py3-none-any.whl is already on the index" in message
    assert sorted(p.name for p in server.packages.iterdir()) == [
        "tiny_kernels-0.3.0-py3-none-any.whl", "tiny_kernels-0.3.0-py3-none-manylinux_2_28_x86_64.whl"]
    units = {u.id: u for u in run.units() if u.id.startswith("publish/pypi/")}
    assert {k: u.state for k, u in units.items()} == {
        "publish/pypi/tiny_kernels-0.3.0-py3-none-any.whl": "failed",
        "publish/pypi/tiny_kernels-0.3.0-py3-none-manylinux_2_28_x86_64.whl": "completed"}
    assert "upload_plan" in run.info() and "| refuse |" in run.info()["upload_plan"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a whole release up to its plan on a busy 2-core machine
def test_a_dry_run_shows_the_upload_plan_and_a_refusal_stops_it_before_anything_moves(prefect_server, server,
                                                                                       tmp_path, capsys):
    from kiln.flows.report.summary import print_summary  # what `kiln release --dry-run` prints at its end

    config = _project(tmp_path, server, None)  # a dry run needs no token: it sends nothing
    taken = make_wheel(tmp_path / "elsewhere", "tiny-kernels", "0.3.0", payload="someone else's bytes")
    send_file(taken, Endpoint("pypi", server.url, server.index_url), IndexCredentials("kiln", TOKEN))
    out = tmp_path / "out"
    state = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), dry_run=True,
                                  return_state=True)
    assert state.is_failed()
    assert "the upload plan refuses files (nothing was published): upload to pypi refused:" in state.message
    assert "tiny_kernels-0.3.0-py3-none-any.whl is already on the index with sha256" in state.message
    assert server.uploads() == 1  # only the file seeded above
    capsys.readouterr()
    print_summary(out / "latest")
    printed = capsys.readouterr().out
    assert "PyPI variant: `cpu`: `tiny_kernels-0.3.0+cpu-py3-none-any.whl` → `tiny_kernels-0.3.0-py3-none-any.whl`" in (
        printed)
    assert "| `tiny_kernels-0.3.0-py3-none-any.whl` |" in printed and "| refuse |" in printed


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two whole releases and a refusal on a busy 2-core machine
def test_a_release_whose_upload_failed_resumes_from_the_same_commit_and_another_commit_is_refused(
        prefect_server, tmp_path):
    from prefect.blocks.system import Secret

    block = f"kiln-pypi-{uuid.uuid4().hex[:8]}"
    Secret(value="a-wrong-token").save(block)  # injected fault: the index refuses the first upload
    with pypi_server(tmp_path / "pypiserver", token=TOKEN) as server:
        config = _project(tmp_path, server, block)
        out = tmp_path / "out"
        first = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), return_state=True)
        assert first.is_failed() and "pypi" in (first.message or ""), first.message
        channel = sorted(p for p in (out / "index").rglob("*.whl"))
        assert channel and not list(server.packages.iterdir())  # Kiln's channel is published; PyPI has nothing
        before = {p: p.stat().st_mtime_ns for p in channel}

        Secret(value=TOKEN).save(block, overwrite=True)  # the fault is gone; the commit is the same
        again = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), return_state=True)
        assert again.is_completed(), again.message
        assert sorted(p.name for p in server.packages.iterdir()) == ["tiny_kernels-0.3.0-py3-none-any.whl"]
        assert {p: p.stat().st_mtime_ns for p in channel} == before  # the channel's files were kept, not rewritten
        sent = server.uploads()

        (config.parent / "CHANGES.txt").write_text("a later change\n")
        commit_all(config.parent, "a change after the release")
        other = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), return_state=True)
        assert other.is_failed()
        assert "0.3.0 is already published on the release channel from commit" in (other.message or ""), other.message
        assert server.uploads() == sent  # nothing sent for the refused release
