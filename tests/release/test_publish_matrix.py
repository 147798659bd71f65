"""A matrix variant's cells publish to one index, the variant's own (issue 45): ``nightly/cpu/simple`` holds the
wheel of every Python, so pip and uv pick the one whose tag fits, as on PyTorch's and flash-attention's indexes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from kiln.core.manifest import RunManifest, Unit
from kiln.core.store import LocalStore
from kiln.flows.report.hint import install_command, install_reason
from kiln.release.publish.closure import resolve_all
from kiln.release.publish.protocol import (
    DependencyCheck,
    PublishRequest,
    PublishSteps,
    complete_commit_indexes,
    publish,
)
from kiln.tasks.install_hint import install_facts
from tests.helpers.wheelkit import make_wheel

COMMIT = "c0ffee" + "0" * 34
CELLS = {"cpupy310": "cp310", "cpupy312": "cp312", "cpupy313": "cp313"}
INDEXES = dict.fromkeys(CELLS, "cpu")


def _run(root: Path, units: list[Unit] = ()) -> RunManifest:
    """A saved run with one ``demo`` wheel per cell, tagged for its Python, plus a plain ``cu130`` variant."""
    run = RunManifest(root=root, run_id=uuid.uuid4().hex, flow="test")
    for cell, python in CELLS.items():
        path = make_wheel(root / "wheels" / cell, "demo", "1.0.dev1+cpu", tag=f"{python}-{python}-linux_x86_64",
                          requires=["helper==2.0"])
        run.add_artifact(path, step="build", kind="wheel", variant=cell)
    run.add_artifact(make_wheel(root / "wheels" / "cu130", "demo", "1.0.dev1+cu130", requires=["helper==2.0"]),
                     step="build", kind="wheel", variant="cu130")
    for unit in units:
        run.add_unit(unit)
    run.save()
    return run


def _publish(run: RunManifest, store: LocalStore, tmp_path: Path, dependencies: DependencyCheck | None = None):
    pin = make_wheel(tmp_path / "pins", "helper", "2.0")
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=[*CELLS, "cu130"],
                                              extra=[(None, pin)], commit=COMMIT, indexes=INDEXES),
                   PublishSteps(clock=lambda: 1e9, dependencies=dependencies))


def _files(store: LocalStore, index: str) -> list[str]:
    return sorted(f["filename"] for f in json.loads(store.get(f"{index}/demo/index.json") or b"{}")["files"])


def test_every_cell_goes_into_its_variants_one_index_with_its_commit_index_and_one_hint(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    # the dependency check asks pip as each cell's Python would install (pip --python-version), from the shared index
    plan = _publish(_run(tmp_path / "run"), store, tmp_path, DependencyCheck(resolve_all))
    assert plan.skipped == {} and plan.commit_held == {}
    assert sorted(p.name for p in (tmp_path / "index" / "nightly").iterdir()) == ["cpu", "cu130"]
    assert _files(store, "nightly/cpu/simple") == [f"demo-1.0.dev1+cpu-{t}-{t}-linux_x86_64.whl"
                                                   for t in CELLS.values()]
    helper = json.loads(store.get("nightly/cpu/simple/helper/index.json") or b"")["files"]
    assert len(helper) == 1 and len([u for u in plan.uploads if u.dist.project == "helper"]) == 2  # once per index
    assert plan.commit_indexes == [f"nightly/cpu/commits/{COMMIT[:12]}/simple",
                                   f"nightly/cu130/commits/{COMMIT[:12]}/simple"]
    assert len(_files(store, plan.commit_indexes[0])) == 3
    units = sorted(u.unit_id for u in plan.uploads if u.index == "nightly/cpu/simple")
    assert units[0] == "publish/cpu/helper-2.0-py3-none-any.whl" and "publish/cpupy312/" in units[2]  # a unit per cell

    install = install_facts("demo", [], plan, check=False)
    assert sorted(install["indexes"]) == [f"{store.url}/nightly/cpu/simple/", f"{store.url}/nightly/cu130/simple/"]
    url = f"{store.url}/nightly/cpu/simple/"
    assert install["indexes"][url]["pythons"] == ["cp310", "cp312", "cp313"]
    assert "pythons" not in install["indexes"][f"{store.url}/nightly/cu130/simple/"]
    assert "demo==1.0.dev1+cpu" in install_command(url, install)  # one command for every Python
    assert "for each of cp310, cp312, cp313: pip and uv install the one of the Python" in install_reason(url, install)


def test_a_failed_cell_is_left_out_of_the_index_and_the_others_go_in(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    failed = Unit("test/unit/cpupy312", "test", "failed", variant="cpupy312", suite="unit")
    plan = _publish(_run(tmp_path / "run", [failed]), store, tmp_path)
    assert list(plan.skipped) == ["cpupy312"]
    assert _files(store, "nightly/cpu/simple") == ["demo-1.0.dev1+cpu-cp310-cp310-linux_x86_64.whl",
                                                   "demo-1.0.dev1+cpu-cp313-cp313-linux_x86_64.whl"]


def test_a_cell_whose_upload_did_not_verify_holds_back_its_variants_whole_commit_index(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    plan = _publish(_run(tmp_path / "run"), store, tmp_path)
    lost = next(r for r in plan.results if r.upload.variant == "cpupy312")
    ready, held = complete_commit_indexes([r.upload for r in plan.results],
                                          [r for r in plan.results if r is not lost])
    assert list(held) == ["cpu"] and "cp312" in held["cpu"]
    assert {r.upload.index_name for r in ready if r.upload.commit_index} == {"cu130"}
