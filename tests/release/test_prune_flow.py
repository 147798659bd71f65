"""``kiln prune`` as a user runs it (the CLI, a real Prefect server), and what pip and uv make of a yank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.store import LocalStore
from kiln.flows.cli import main
from kiln.release.publish.prune import Retention, prune
from tests.helpers.staticserver import static_server

from .test_prune import CPU, T0, _files, _local_read, _publish, _snapshot, broken_links
from .test_publish_flow import KILN_TOML

pytestmark = pytest.mark.slow
INSTALL_TIMEOUT_S = 300
RETENTION = "\n[publish.retention]\nkeep = 1\ngrace_days = {grace}\n"


def _project(tmp_path: Path, grace: float, s3_endpoint: str, s3_bucket: str) -> tuple[str, LocalStore]:
    (tmp_path / "src").mkdir()
    config = tmp_path / "kiln.toml"
    config.write_text(KILN_TOML.format(bucket=s3_bucket, endpoint=s3_endpoint) + RETENTION.format(grace=grace))
    store = LocalStore(tmp_path / "out" / "index")  # the config's local target, file://{out}/index
    for n in (1, 2):
        _publish(tmp_path, store, n)
    return str(config), store


def test_kiln_prune_dry_run_prints_the_plan_and_a_real_one_removes_the_older_commit(
        prefect_server, tmp_path: Path, s3_endpoint: str, s3_bucket: str, capsys) -> None:
    config, store = _project(tmp_path, 0, s3_endpoint, s3_bucket)
    before = _snapshot(store.root)
    argv = ["prune", "--config", config, "--out", str(tmp_path / "out")]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and f"`{CPU}/demo/demo-1.0.dev1-py3-none-any.whl`" in out, out
    assert _snapshot(store.root) == before
    assert main(argv) == 0
    assert "delete objects (did): 2" in capsys.readouterr().out
    assert list(_files(store)) == ["demo-1.0.dev2-py3-none-any.whl"]
    assert broken_links(_local_read(store.root), store.list("")) == []
    assert main(["prune", "--config", config, "--channel", "release"]) != 0
    assert "releases are never pruned" in capsys.readouterr().err


def _pip_download(url: str, requirement: str, dest: Path) -> tuple[list[str], str]:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--index-url", url,
                           "-d", str(dest), requirement], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return sorted(p.name for p in dest.iterdir()), done.stdout + done.stderr


def _uv_resolve(url: str, requirement: str, tmp: Path) -> tuple[str, str]:
    done = subprocess.run(["uv", "pip", "compile", "-", "--no-header", "--no-cache", "--index-url", url,
                           "--python-version", "3.11"], input=requirement, capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S, cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    return next(line.strip() for line in done.stdout.splitlines() if line.startswith("demo")), done.stderr


def test_during_the_grace_period_a_yanked_nightly_installs_only_when_pinned_and_says_why(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    for n in (1, 2, 3):
        _publish(tmp_path, store, n)
    plan = prune(store, channel="nightly", channel_prefix="nightly", retention=Retention(1, 7), clock=lambda: T0)
    assert sorted(plan.yanked) == [f"{CPU}/demo/demo-1.0.dev{n}-py3-none-any.whl" for n in (1, 2)]
    assert not plan.deleted
    with static_server(store.root) as base:
        url = f"{base.rstrip('/')}/{CPU}/"
        assert _pip_download(url, "demo", tmp_path / "a")[0] == ["demo-1.0.dev3-py3-none-any.whl"]
        assert _uv_resolve(url, "demo", tmp_path)[0] == "demo==1.0.dev3"
        names, output = _pip_download(url, "demo==1.0.dev1", tmp_path / "c")
        assert names == ["demo-1.0.dev1-py3-none-any.whl"]
        assert "yanked" in output and "older than the newest 1 nightlies" in output, output
        pinned, warning = _uv_resolve(url, "demo==1.0.dev1", tmp_path)
        assert pinned == "demo==1.0.dev1" and "yanked" in warning, warning
        # Below the kept version only yanked ones are left: a range that is not a pin takes none of them.
        failed = subprocess.run(["uv", "pip", "compile", "-", "--no-header", "--no-cache", "--index-url", url,
                                 "--python-version", "3.11", "--prerelease", "allow"], input="demo<1.0.dev3",
                                capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, cwd=tmp_path)
        assert failed.returncode != 0 and "yanked" in failed.stderr, failed.stderr
