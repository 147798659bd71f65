"""Runs of their own: per-commit versions, one record per run, re-runs, concurrent runs.

Each test commits a small fixture project in its own git repository and runs
the real flows under the session's Prefect server; the index is a local
directory shared by the runs of a test, as an S3 channel would be. The first
nightly of the unchanged project is made once for the tests that only read it
or add a run after it (``first_nightly``); a test that changes the project or
needs an empty output runs its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiln.core.manifest import RunManifest
from tests.helpers.gitrepo import commit_all, git, git_project, tiny_cpu_only, tiny_cpu_with_numpy
from tests.helpers.indexcheck import check_local_index
from tests.helpers.waiting import until

# Each test runs whole nightlies; on a loaded 2-core machine one takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

COMMIT_TIME = "2026-11-30T21:07:03+00:00"
VERSION = "0.1.0.dev20261130210703"


def _nightly(config: Path, out: Path):
    from kiln.flows.nightly import nightly_flow

    return nightly_flow(config_path=str(config), out=str(out), return_state=True)


def _view(state, out: Path) -> RunManifest:
    """The run the flow state belongs to, as its local view's merged manifest."""
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _project_page(out: Path, project: str = "tiny-kernels") -> dict:
    return json.loads((out / "index" / "nightly" / "cpu" / "simple" / project / "index.json").read_text())


@dataclass(frozen=True)
class FirstNightly:
    config: Path
    out: Path
    state: Any  # the flow's final Prefect state
    latest: Path  # what out/latest named right after it, before any later run of the module moved it


@pytest.fixture(scope="module")
def first_nightly(prefect_server, tmp_path_factory) -> FirstNightly:
    """One nightly of the committed tiny CPU project, into an empty output (most of a minute on a loaded machine).

    The checkout also holds an untracked file: untracked files do not make a tree dirty.
    """
    base = tmp_path_factory.mktemp("first-nightly")
    config = git_project("tiny", base, edit=tiny_cpu_only)
    (config.parent / "notes.txt").write_text("untracked files do not make a tree dirty\n")
    out = base / "out"
    state = _nightly(config, out)
    return FirstNightly(config, out, state, (out / "latest").resolve())


def test_nightly_version_names_the_commit_and_the_wheel_records_it(first_nightly):
    out, state = first_nightly.out, first_nightly.state
    assert state.is_completed(), state.message
    run = _view(state, out)
    assert run.version == VERSION
    commit = git(first_nightly.config.parent, "rev-parse", "HEAD")
    assert run.info["commit"] == commit
    (wheel,) = run.artifacts_of("wheel")
    with zipfile.ZipFile(run.root / wheel.path) as archive:
        info = json.loads(archive.read(f"tiny_kernels-{VERSION}+cpu.dist-info/kiln_build.json"))
    assert info["commit"] == commit
    assert first_nightly.latest == run.root


def test_a_second_nightly_of_the_same_commit_publishes_nothing_and_succeeds(first_nightly):
    out, first = first_nightly.out, first_nightly.state
    second = _nightly(first_nightly.config, out)
    assert first.is_completed(), first.message
    assert second.is_completed(), second.message
    one, two = _view(first, out), _view(second, out)
    assert one.run_id != two.run_id and one.version == two.version
    uploads = [u for u in two.units if u.stage == "publish" and u.id != "publish/pages"
               and not u.id.startswith("publish/dependencies/")]
    assert uploads and {u.message for u in uploads} == {"already present"}
    checks = [u for u in two.units if u.id.startswith("publish/dependencies/")]
    assert checks and all("answered by an identical check" in u.message for u in checks)  # the first's answer
    assert [u.id for u in one.units] == [u.id for u in two.units]  # each summary is its own run's
    assert {a.sha256 for a in one.artifacts_of("wheel")} == {a.sha256 for a in two.artifacts_of("wheel")}


def test_a_new_commit_publishes_a_higher_version_beside_the_old_one(prefect_server, tinycpu, tmp_path):
    out = tmp_path / "out"
    assert _nightly(tinycpu, out).is_completed()
    add = tinycpu.parent / "tinyk" / "add.py"
    add.write_text(add.read_text() + "\n# a change to one kernel\n")
    commit_all(tinycpu.parent, "change add", "2026-12-01T02:00:00+00:00")
    state = _nightly(tinycpu, out)
    assert state.is_completed(), state.message
    page = _project_page(out)
    assert page["versions"] == [f"{VERSION}+cpu", "0.1.0.dev20261201020000+cpu"]
    assert check_local_index(out / "index").problems == []


def test_modified_tracked_files_are_refused_for_publishing(prefect_server, tinycpu, tmp_path):
    out = tmp_path / "out"
    add = tinycpu.parent / "tinyk" / "add.py"
    add.write_text(add.read_text() + "\n# not committed\n")
    state = _nightly(tinycpu, out)
    assert state.is_failed()
    run = _view(state, out)
    refused = {u.id: u for u in run.units}["publish/source"]
    assert refused.state == "failed"
    assert "tinyk/add.py" in refused.message and "commit them" in refused.message
    assert not (out / "index").exists()  # nothing was published
    assert [u.state for u in run.units if u.stage == "build"] == ["completed"]  # the local build still works


def test_two_nightlies_of_different_commits_at_once_share_nothing(prefect_env, tinycpu, tmp_path):
    shared = tmp_path / "shared-index"
    text = tinycpu.read_text().replace('url = "file://{out}/index"', f'url = "{shared.as_uri()}"')
    tinycpu.write_text(text)
    commit_all(tinycpu.parent, "shared target", COMMIT_TIME)
    other = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(tinycpu.parent), str(other)], check=True, timeout=60)
    scale = other / "tinyk" / "scale.py"
    scale.write_text(scale.read_text() + "\n# the other commit\n")
    commit_all(other, "change scale", "2026-12-01T03:00:00+00:00")
    procs = [subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(config), "--out",
                               str(tmp_path / f"out{n}")], env=prefect_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for n, config in enumerate((tinycpu, other / "kiln.toml"))]
    outputs = [p.communicate(timeout=1500)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    runs = [RunManifest.load(tmp_path / f"out{n}" / "latest") for n in range(2)]
    assert runs[0].run_id != runs[1].run_id
    assert {r.version for r in runs} == {VERSION, "0.1.0.dev20261201030000"}
    for run, output in zip(runs, outputs, strict=False):
        assert f"run {run.run_id}" in output
        assert {a.variant for a in run.artifacts_of("wheel")} == {"cpu"}
    page = json.loads((shared / "nightly" / "cpu" / "simple" / "tiny-kernels" / "index.json").read_text())
    assert len(page["files"]) == 2  # no entry lost
    assert check_local_index(shared).problems == []


def test_a_failed_upload_is_failed_in_the_record_and_in_prefect(prefect_server, tinycpu, tmp_path):
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    out = tmp_path / "out"
    name = f"tiny_kernels-{VERSION}+cpu-py3-none-any.whl"
    squatter = out / "index" / "nightly" / "cpu" / "simple" / "tiny-kernels" / name
    squatter.parent.mkdir(parents=True)
    squatter.write_bytes(b"not the wheel this commit builds")
    state = _nightly(tinycpu, out)
    assert state.is_failed()
    run = _view(state, out)
    unit = {u.id: u for u in run.units}[f"publish/cpu/{name}"]
    assert unit.state == "failed" and "IntegrityError" in unit.message and "RECORD" in unit.message
    def of_this_run(client) -> list:
        # the server is the test session's: other tests' publishes upload a file of this name too, some from a
        # publish run of their own (no parent task run)
        uploads = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[f"upload cpu/{name}"])))
        parents = {t.id: client.read_flow_run(t.flow_run_id).parent_task_run_id for t in uploads}
        return [t for t in uploads if parents[t.id] is not None
                and client.read_task_run(parents[t.id]).flow_run_id == UUID(run.run_id)]

    with get_client(sync_client=True) as client:
        # Task-run states reach the server through Prefect's events worker, after the flow returned.
        tasks = until(lambda: of_this_run(client), lambda ts: bool(ts) and all(t.state and t.state.is_failed() for t in ts))
    assert tasks and all(t.state.is_failed() for t in tasks)


def test_the_test_stage_fails_on_a_wheel_missing_a_module_the_checkout_has(prefect_server, tinycpu, tmp_path,
                                                                          monkeypatch):
    from kiln.flows.test import test_flow
    from kiln.tasks.wheel import assemble as wheel

    sources = wheel.package_files

    def drop_scale(config):  # fault injection: a wheel built without one of the package's modules
        return [(path, arc) for path, arc in sources(config) if not arc.endswith("scale.py")]

    monkeypatch.setattr(wheel, "package_files", drop_scale)
    out = tmp_path / "out"
    state = test_flow(config_path=str(tinycpu), out=str(out), return_state=True)
    assert state.is_failed()
    run = _view(state, out)
    unit = {u.id: u for u in run.units}["test/tiny/cpu"]
    assert unit.state == "failed" and "test_every_module_imports" in unit.message
    # The same tests pass against the checkout: it has tinyk/scale.py.
    checkout = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                              cwd=tinycpu.parent, env={"PYTHONPATH": str(tinycpu.parent), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=300)
    assert checkout.returncode == 0, checkout.stdout[-2000:]


def test_a_required_gpu_suite_without_gpus_is_not_run_and_the_gate_follows_the_setting(prefect_server, tinycpu,
                                                                                     tmp_path, monkeypatch):
    from kiln.flows.nightly import nightly_flow

    monkeypatch.setenv("KILN_GPU_COUNT", "0")
    text = tinycpu.read_text().replace('[[suites]]\nname = "tiny"\npaths = ["tests"]\n',
                                       '[[suites]]\nname = "tiny"\npaths = ["tests"]\n\n'
                                       '[[suites]]\nname = "tiny-gpu"\npaths = ["tests"]\ngpus = 1\n'
                                       'variants = ["cpu"]\nPUBLISH\n')
    for allowed, published in (("false", False), ("true", True)):
        tinycpu.write_text(text.replace("PUBLISH", f"publish_untested = {allowed}"))
        commit_all(tinycpu.parent, f"publish_untested = {allowed}", COMMIT_TIME)
        out = tmp_path / f"out-{allowed}"
        state = nightly_flow(config_path=str(tinycpu), out=str(out), return_state=True)
        run = _view(state, out)
        gpu = {u.id: u for u in run.units}["test/tiny-gpu/cpu"]
        assert gpu.state == "not_run" and "needs 1 GPU, 0 on this machine" in gpu.message
        assert (out / "index" / "nightly" / "cpu").exists() == published
        if published:
            assert run.info["published_untested"] == {"cpu": "tiny-gpu: needs 1 GPU, 0 on this machine"}
            from kiln.flows.report.summary import render_text

            assert "PUBLISHED UNTESTED on its hardware: cpu" in render_text(run).splitlines()[1]
        else:
            assert "not run: test/tiny-gpu/cpu" in {u.id: u for u in run.units}["publish/cpu"].message


def test_a_cpu_wheel_installs_from_the_runs_index_with_only_the_indexes_it_needs(prefect_server, tmp_path):
    """``pip install`` with no configuration of its own: the run's index, plus one for third-party wheels."""
    numpy = sorted(Path("/opt/pypi/files").glob("numpy-*-cp311-cp311-manylinux*_x86_64.whl"))
    triton = sorted(Path("/opt/pypi/files").glob("triton-*-cp311-cp311-manylinux*_x86_64.whl"))
    if not numpy or not triton:
        pytest.skip("no local numpy and triton wheels to serve as the third-party index (this machine's /opt/pypi)")

    config = git_project("tiny", tmp_path, edit=tiny_cpu_with_numpy)
    out = tmp_path / "out"
    state = _nightly(config, out)
    assert state.is_completed(), state.message
    third_party = tmp_path / "third-party"
    third_party.mkdir()
    shutil.copy(numpy[-1], third_party)
    shutil.copy(triton[-1], third_party)  # the cpu wheel's declared triton, unpinned
    from kiln.flows.cli import main

    assert main(["index", str(third_party), "--out", str(tmp_path / "deps")]) == 0
    venv = tmp_path / "venv"
    # No pip of its own (ensurepip costs seconds to tens of seconds per venv): the test environment's pip
    # installs into it (--python), in the same bare environment.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    env = {"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-cache-dir",
         "--index-url",
         (out / "index" / "nightly" / "cpu" / "simple").as_uri(), "--extra-index-url", (tmp_path / "deps").as_uri(),
         "tiny-kernels"], env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import numpy, tinyk; print(tinyk.__file__)"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and str(venv) in probe.stdout, probe.stderr


def test_two_builds_of_one_commit_in_two_clones_give_byte_identical_wheels(prefect_server, tmp_path):
    from importlib.metadata import version

    from kiln.flows.build import build_flow

    first = git_project("tiny", tmp_path / "a")
    second = tmp_path / "b" / "tiny"
    subprocess.run(["git", "clone", "-q", str(first.parent), str(second)], check=True, timeout=60)
    wheels, variant_wheels = [], []
    for config in (first, second / "kiln.toml"):  # separate directories, separate build caches
        out = config.parent / "out"
        state = build_flow(config_path=str(config), out=str(out), return_state=True)
        assert state.is_completed(), state.message
        run = _view(state, out)
        wheels.append({Path(a.path).name: a.sha256 for a in run.artifacts_of("wheel")})
        variant_wheels.append({Path(a.path).name: a.sha256 for a in run.artifacts_of("variant-wheel")})
    assert wheels[0] == wheels[1]
    assert variant_wheels[0] == variant_wheels[1]  # the PEP 825 variant wheels too
    assert sorted(name.removesuffix(".whl").split("-")[-1] for name in variant_wheels[0]) == [
        "any", "cu130", "null", "rocm"]  # "any": the plain default wheel's platform tag, no label
    assert {name.split("+")[1].split("-")[0] for name in wheels[0]} == {"cu130", "rocm", "cpu"}
    gpu = next(p for p in (first.parent / "out" / "latest" / "wheels").iterdir() if "+cu130" in p.name)
    with zipfile.ZipFile(gpu) as archive:
        metadata = archive.read(f"tiny_kernels-{VERSION}+cu130.dist-info/METADATA").decode()
    assert f"Requires-Dist: triton=={version('triton')}\n" in metadata  # the cubins load only under it
