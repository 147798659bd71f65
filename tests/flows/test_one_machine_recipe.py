"""The deploy guide's one-machine recipe (docs/guides/deploying.md) on a CPU-only machine, then `kiln nightly` there: done in minutes.

A real ``prefect server`` gets the guide's work pools and ``prefect deploy
--all`` (so ``test/kiln-gpu`` exists, with no worker on ``kiln-gpu``); then
``kiln nightly`` runs on the same server for a committed project whose GPU
suite lives on ``kiln-gpu``. The suite must be "not run" at once, naming the
pool and how to start its worker, in the command's output, its summary and
its record; nothing is dispatched to a pool that no worker serves, and the
nightly's run is named for its version and commit.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.gitrepo import git, git_project
from tests.helpers.prefect_server import PrefectServer, prefect_server_process
from tests.release_flow.test_readme import readme_commands

# A real server migrating a fresh database, deployments and a whole nightly on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REASON = "no live worker in pool 'kiln-gpu' (start one: prefect worker start --pool kiln-gpu)"
GPU_SUITE = """
[[suites]]
name = "tiny-gpu"
paths = ["tests"]
gpus = 1
pool = "kiln-gpu"          # prefect.yaml deploys test/kiln-gpu
publish_untested = true
"""


def _with_gpu_suite(repo: Path) -> None:
    config = repo / "kiln.toml"
    config.write_text(config.read_text() + GPU_SUITE)


def _deploy_as_the_readme_says(server: PrefectServer) -> None:
    """The guide's commands up to its workers: pools, limits, ``prefect deploy --all``; no worker at all."""
    for words in readme_commands():
        if words[0] != "prefect" or words[1] in ("config", "worker", "deployment"):
            continue  # the server's URL is in the environment; this machine starts no worker
        proc = server.cli(*words[1:], timeout=300, check=False)
        assert proc.returncode == 0, f"{shlex.join(words)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def nightly(tmp_path_factory):
    base = tmp_path_factory.mktemp("one-machine")
    (base / "home").mkdir()
    config = git_project("tiny", base, edit=_with_gpu_suite)
    with prefect_server_process(base / "home") as server:
        _deploy_as_the_readme_says(server)
        env = {**server.env, "KILN_GPU_COUNT": "0"}  # a CPU-only machine, whatever this one has
        proc = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(config),
                               "--out", str(base / "out")], cwd=config.parent, env=env, capture_output=True,
                              text=True, timeout=1200)
        with server.client() as client:
            gpu = client.read_deployment_by_name("test/kiln-gpu")
            runs = client.read_flow_runs()
            summaries = [a.data for a in client.read_artifacts() if a.key == "kiln-nightly-summary"]
        yield proc, base / "out" / "latest", config, gpu, runs, summaries


def test_the_nightly_ends_and_its_output_and_summary_name_the_pool_its_gpu_suite_lacked(nightly):
    proc, _, _, _, _, summaries = nightly
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert f"suite tiny-gpu: not run: {REASON}" in output, output[-5000:]  # logged while it ran
    summary = proc.stdout.split("manifest:", 1)[0]  # the summary printed before the links
    assert "test/tiny-gpu/cu130" in summary and REASON in summary, summary[-3000:]
    (markdown,) = summaries  # the run's summary artifact in the UI
    assert "test/tiny-gpu/cu130" in markdown and REASON in markdown, markdown


def test_the_gpu_suite_is_recorded_not_run_naming_the_pool_and_nothing_was_dispatched(nightly):
    _, latest, _, gpu, runs, _ = nightly
    manifest = json.loads((latest / "run.json").read_text())
    gpu_units = {u["id"]: u for u in manifest["units"] if u["suite"] == "tiny-gpu"}
    assert set(gpu_units) == {"test/tiny-gpu/cu130", "test/tiny-gpu/rocm"}
    for unit in gpu_units.values():
        assert unit["state"] == "not_run" and unit["message"].startswith(f"not run: {REASON}"), unit
    assert [r.name for r in runs if r.deployment_id == gpu.id] == [], "a run no worker would take was dispatched"


def test_the_nightlys_run_is_named_for_its_version_and_commit(nightly):
    _, latest, config, _, runs, _ = nightly
    manifest = json.loads((latest / "run.json").read_text())
    sha12 = git(config.parent, "rev-parse", "HEAD")[:12]
    (mine,) = [r for r in runs if str(r.id) == manifest["run_id"]]
    assert mine.name == f"nightly {manifest['version']} @ {sha12}"
    names = {r.name for r in runs}
    assert {f"build cu130, rocm, cpu @ {sha12}", f"test tiny @ {sha12}", f"bench cpu @ {sha12}",
            f"publish nightly {manifest['version']} @ {sha12}"} <= names, names
