"""Two nightlies of two commits: each commit's own index, the channel's both, pip installs a commit's version.

The tiny fixture project committed in its own git repository, run by the real
nightly flow under the session's Prefect server; the index is a local
directory shared by the runs, as an S3 channel would be.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from tests.helpers.gitrepo import commit_all, git, git_project, tiny_cpu_with_numpy
from tests.helpers.indexcheck import check_local_index

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _nightly(config: Path, out: Path) -> RunManifest:
    from kiln.flows.nightly import nightly_flow

    state = nightly_flow(config_path=str(config), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _versions(index: Path, project: str = "tiny-kernels") -> list[str]:
    return json.loads((index / project / "index.json").read_text())["versions"]


def _third_party_index(tmp_path: Path) -> Path:
    """A local index of the numpy and triton wheels the tiny wheel needs (this machine's /opt/pypi)."""
    numpy = sorted(Path("/opt/pypi/files").glob("numpy-*-cp311-cp311-manylinux*_x86_64.whl"))
    triton = sorted(Path("/opt/pypi/files").glob("triton-*-cp311-cp311-manylinux*_x86_64.whl"))
    if not numpy or not triton:
        pytest.skip("no local numpy and triton wheels to serve as the third-party index (this machine's /opt/pypi)")
    wheels = tmp_path / "third-party"
    wheels.mkdir()
    shutil.copy(numpy[-1], wheels)
    shutil.copy(triton[-1], wheels)
    from kiln.flows.cli import main

    assert main(["index", str(wheels), "--out", str(tmp_path / "deps")]) == 0
    return tmp_path / "deps"


def test_each_commit_has_an_index_of_its_own_version_and_pip_installs_it(prefect_server, tmp_path: Path) -> None:
    deps = _third_party_index(tmp_path)
    config = git_project("tiny", tmp_path, edit=tiny_cpu_with_numpy)
    repo, out = config.parent, tmp_path / "out"
    first = _nightly(config, out)
    first_commit = git(repo, "rev-parse", "HEAD")
    add = repo / "tinyk" / "add.py"
    add.write_text(add.read_text() + "\n# a change to one kernel\n")
    second_commit = commit_all(repo, "change add", "2026-12-01T02:00:00+00:00")
    second = _nightly(config, out)
    assert first.version != second.version

    index = out / "index" / "nightly" / "cpu"
    one, two = (index / "commits" / c[:12] / "simple" for c in (first_commit, second_commit))
    assert first.info["commit_index_url"] == [one.as_uri() + "/"]
    assert second.info["commit_index_url"] == [two.as_uri() + "/"]
    assert _versions(one) == [f"{first.version}+cpu"] and _versions(two) == [f"{second.version}+cpu"]
    assert _versions(index / "simple") == [f"{first.version}+cpu", f"{second.version}+cpu"]
    for commit_index in (one, two):  # what went beside the wheel goes in the commit's index too
        projects = json.loads((commit_index / "index.json").read_text())["projects"]
        assert sorted(p["name"] for p in projects) == ["kiln-runtime", "tiny-kernels"]

    wheels = [p for p in (out / "index").rglob("*") if p.is_file() and p.name.endswith((".whl", ".metadata"))]
    assert all("commits" not in p.relative_to(out / "index").parts for p in wheels)  # pages only there
    assert max(Counter(p.name for p in wheels).values()) == 1  # no object stored twice
    report = check_local_index(out / "index")  # every link of every page, the commits' included
    assert not report.problems, report.problems
    assert report.pages == 3 * 3  # (root, tiny-kernels, kiln-runtime) x (channel, two commits)

    venv = tmp_path / "venv"
    # No pip of its own (ensurepip costs seconds to tens of seconds per venv): the test environment's pip
    # installs into it (--python), in the same bare environment.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    env = {"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-cache-dir",
         "--index-url", one.as_uri(),
         "--extra-index-url", deps.as_uri(), "tiny-kernels"], env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m, tinyk; print(m.version('tiny-kernels')); print(tinyk.__file__)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    installed, where = probe.stdout.split()
    assert installed == f"{first.version}+cpu" and str(venv) in where  # the older commit's, not the channel's newest
