"""build_flow under Prefect on the fixture projects: artifacts, wheels, cache, failure isolation."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest

from kiln.core.fsutil import sha256_file
from kiln.core.manifest import RunManifest
from kiln.tasks.build.aot import elf_arch
from tests.helpers.projects import copy_project

pytestmark = pytest.mark.slow


def _build(config: Path, out: Path):
    from kiln.flows.build import build_flow

    state = build_flow(str(config), str(out), version="0.1.0.dev20261129", return_state=True)
    return state, RunManifest.load(out / str(state.state_details.flow_run_id))


def _units(run: RunManifest) -> dict:
    return {u.id: u for u in run.units}


def _compiled(run: RunManifest) -> dict:
    return {u.id: u.cache for u in run.units if u.cache}


@pytest.fixture(scope="module")
def tiny_build(prefect_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    config = copy_project("tiny", root)
    state, run = _build(config, root / "out")
    return config, root, state, run


def test_tiny_build_produces_exactly_the_planned_artifacts(tiny_build):
    _, root, state, run = tiny_build
    assert state.is_completed()
    units = _units(run)
    assert sorted(_compiled(run)) == [
        "build/cu130/8.0/add/fp32_b64", "build/cu130/8.0/scale/fp32_b64",
        "build/cu130/9.0/add/fp32_b64", "build/rocm/gfx942/add/fp32_b64",
    ]
    assert set(_compiled(run).values()) == {"miss"}
    skip = units["build/rocm/-/scale/-"]
    assert skip.state == "skipped" and "'scale'" in skip.message
    binaries = run.artifacts_of("cubin") + run.artifacts_of("hsaco")
    assert len(binaries) == 4
    for artifact in binaries:
        arch = artifact.path.split("/")[2]
        want = arch if arch.startswith("gfx") else f"sm_{arch.replace('.', '')}"
        assert elf_arch(run.verify(artifact).read_bytes()) == want
    for artifact in run.artifacts:
        assert sha256_file(run.verify(artifact)) == artifact.sha256
    manifest = json.loads((run.root / "build" / "cu130" / "manifest.json").read_text())
    assert sorted(e["path"] for e in manifest) == [
        "8.0/add/add_kernel__fp32_b64.cubin", "8.0/scale/scale_kernel__fp32_b64.cubin", "9.0/add/add_kernel__fp32_b64.cubin"]


def test_tiny_build_writes_one_wheel_per_variant(tiny_build):
    _, root, _, run = tiny_build
    wheels = sorted(Path(a.path).name for a in run.artifacts_of("wheel"))
    assert [w.split("-")[1] for w in wheels] == ["0.1.0.dev20261129+cpu", "0.1.0.dev20261129+cu130",
                                                 "0.1.0.dev20261129+rocm"]
    rocm = next(run.root / a.path for a in run.artifacts_of("wheel", "rocm"))
    with zipfile.ZipFile(rocm) as archive:
        (entry,) = json.loads(archive.read("tinyk/_aot/manifest.json"))
        assert elf_arch(archive.read(f"tinyk/_aot/{entry['path']}")) == "gfx942"
    assert _units(run)["build/cu130/wheel"].state == "completed"


def test_warm_rebuild_hits_then_drift_heals_and_one_kernel_change_rebuilds_only_it(tiny_build):
    config, root, _, _ = tiny_build
    state, run = _build(config, root / "warm")
    assert state.is_completed() and set(_compiled(run).values()) == {"hit"}

    # damage the cached cubin of cu130/8.0/add and delete the one of rocm/gfx942/add
    cache = config.parent / ".kiln" / "cache"
    stored = [json.loads(p.read_text()) for p in cache.glob("entries/*/*.json")]
    entries = {e["info"]["unit"]: e for e in stored if "unit" in e["info"]}  # the others: wheels and their SBOMs
    assert {e["info"].get("kind") for e in stored if "unit" not in e["info"]} == {"wheel", "sbom"}

    def obj(unit_id):
        sha = next(f["sha256"] for n, f in entries[unit_id]["files"].items() if not n.endswith(".json"))
        return cache / "objects" / sha[:2] / sha

    data = obj("build/cu130/8.0/add/fp32_b64").read_bytes()
    obj("build/cu130/8.0/add/fp32_b64").write_bytes(data[: len(data) // 2])
    obj("build/rocm/gfx942/add/fp32_b64").unlink()
    state, run = _build(config, root / "drift")
    assert state.is_completed()
    events = run.info["build_cache_events"]
    assert len(events) == 2 and all("invalidated batch" in e for e in events)
    # the whole batch of `add` per backend rebuilt; `scale` (another batch) still hit
    assert _compiled(run) == {
        "build/cu130/8.0/add/fp32_b64": "miss", "build/cu130/9.0/add/fp32_b64": "miss",
        "build/rocm/gfx942/add/fp32_b64": "miss", "build/cu130/8.0/scale/fp32_b64": "hit",
    }
    for artifact in run.artifacts:
        run.verify(artifact)

    scale = config.parent / "tinyk" / "scale.py"
    scale.write_text(scale.read_text().replace("* alpha", "* alpha * 2.0"))
    state, run = _build(config, root / "edited")
    assert state.is_completed()
    assert {u: c for u, c in _compiled(run).items() if c == "miss"} == {"build/cu130/8.0/scale/fp32_b64": "miss"}


def test_failed_unit_is_recorded_others_build_and_its_variant_gets_no_wheel(prefect_server, tmp_path):
    config = copy_project("broken", tmp_path)
    state, run = _build(config, tmp_path / "out")
    assert state.is_failed() and "1 of" in state.message
    units = _units(run)
    failed = units["build/cu130/8.0/fp8cast/fp32_b64"]
    assert failed.state == "failed" and failed.arch == "8.0" and failed.kernel == "fp8cast"
    assert "fp32_b64" in failed.message and "fp8e4nv not supported" in failed.message
    assert {uid for uid, u in units.items() if u.state == "completed"} >= {
        "build/cu130/8.0/add/fp32_b64", "build/cu130/9.0/add/fp32_b64", "build/cu130/9.0/fp8cast/fp32_b64"}
    assert units["build/cu130/wheel"].state == "skipped"
    assert units["build/cu130/wheel"].message == "not built: 1 units of cu130 failed"
    assert [Path(a.path).name.split("-")[1] for a in run.artifacts_of("wheel")] == ["0.1.0.dev20261129+cpu"]


def test_each_compile_unit_is_a_task_run_named_after_it(tiny_build):
    """The UI's unit table: one task run per compile unit, named ``compile <unit id>`` (a name template)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _, _, state, run = tiny_build
    flow_run_id = state.state_details.flow_run_id
    compiled = sorted(f"compile {unit_id}" for unit_id in _compiled(run))
    names: list[str] = []
    deadline = time.monotonic() + 120  # the server stores task runs from their events, after the flow returned
    with get_client(sync_client=True) as client:
        while names != compiled and time.monotonic() < deadline:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            names = sorted(t.name for t in runs if t.name.startswith("compile"))
            time.sleep(0.2)
    assert compiled and names == compiled
