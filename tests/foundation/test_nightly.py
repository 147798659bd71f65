"""End to end: `kiln nightly --out TMP` on the default kiln.toml.

The nightly runs as a real `kiln` process against the session's Prefect
server; the test then reads what a release engineer would read: run.json,
the index, and a pip install from it into a fresh virtual environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from release.fsutil import sha256_file
from tests.helpers.indexcheck import check_local_index
from tests.helpers.venvs import make_venv, run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nightly(tmp_path_factory, prefect_env):
    out = tmp_path_factory.mktemp("nightly") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "nightly", "--config", str(REPO / "kiln.toml"), "--out", str(out)],
        cwd=REPO, env=prefect_env, capture_output=True, text=True, timeout=1200,
    )
    return out, proc


def test_nightly_exits_zero_and_prints_the_summary(nightly):
    out, proc = nightly
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "manifest:" in proc.stdout and "index:" in proc.stdout


def test_run_manifest_records_every_stage_and_artifact(nightly):
    out, _ = nightly
    manifest = json.loads((out / "run.json").read_text())
    stages = {unit["stage"] for unit in manifest["units"]}
    assert {"build", "test", "bench", "publish"} <= stages
    assert not [u for u in manifest["units"] if u["state"] == "failed"]
    built = {u["variant"] for u in manifest["units"] if u["stage"] == "build" and u["state"] == "completed"}
    assert {"cu130", "rocm", "cpu"} <= built
    wheels = [a for a in manifest["artifacts"] if a["kind"] == "wheel"]
    assert {w["variant"] for w in wheels} == {"cu130", "rocm", "cpu"}
    for artifact in manifest["artifacts"]:
        assert sha256_file(out / artifact["path"]) == artifact["sha256"], artifact["path"]


def test_index_links_resolve_and_hashes_match(nightly):
    out, _ = nightly
    report = check_local_index(out / "index")
    assert report.problems == []
    assert {p.name.split("+")[1].split("-")[0] for p in report.files if p.suffix == ".whl"} == {"cu130", "rocm", "cpu"}


def test_pip_installs_the_cpu_wheel_from_the_index_into_a_fresh_venv(nightly, tmp_path):
    out, _ = nightly
    simple = out / "index" / "nightly" / "cpu" / "simple"  # one PEP 503 root per channel and variant
    python = make_venv(tmp_path / "venv")
    install = run([str(python), "-m", "pip", "install", "--no-deps", "--index-url", simple.as_uri(), "kiln-kernels"],
                  cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run([str(python), "-c", "import kernels, torch; print(kernels.__file__)"], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert str(tmp_path / "venv") in probe.stdout
