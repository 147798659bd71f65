"""Compile seconds spent and saved: the rules, the entry that carries them through both tiers of the unit cache
(older entries without them included), and a real build run twice whose second run spends nothing and saves what
the first recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.store import LocalStore
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.cache_remote import RemoteTier
from kiln.tasks.build.compile_cache import CompileStats, open_compile_cache
from kiln.tasks.build.compile_seconds import (
    FULL,
    CompileSeconds,
    entry_info,
    on_compile,
    on_hit,
    total,
)
from kiln.tasks.build.stage import compile_line
from kiln.tasks.build.units import UnitResult
from tests.helpers.projects import copy_project

FILES = {"libk.so": b"\x7fELF a library"}


def test_a_full_compile_spends_its_time_saves_nothing_and_is_the_full_compile_recorded():
    assert on_compile(12.5, partial=False, last_full=None) == (CompileSeconds(12.5, 0.0), 12.5)
    # a full compile is its own basis, whatever an earlier one took
    assert on_compile(12.5, partial=False, last_full=40.0) == (CompileSeconds(12.5, 0.0), 12.5)


def test_a_partial_compile_saves_the_last_full_compile_less_what_it_spent_and_carries_it_forward():
    assert on_compile(3.0, partial=True, last_full=40.0) == (CompileSeconds(3.0, 37.0), 40.0)
    # slower than the last full compile (a loaded machine): saved nothing, never negative
    assert on_compile(50.0, partial=True, last_full=40.0) == (CompileSeconds(50.0, 0.0), 40.0)
    # no full compile recorded: no basis, said as such, and nothing recorded for a later hit
    assert on_compile(3.0, partial=True, last_full=None) == (CompileSeconds(3.0, None), None)


@pytest.mark.parametrize(("info", "saved"), [
    ({FULL: 40.0, "compile_s": 3.0}, 40.0),
    ({"unit": "u", "toolchain": {}}, None),  # an entry written before seconds were recorded
    ({FULL: "40"}, None), ({FULL: True}, None), ({FULL: -1.0}, None),  # not a usable record
])
def test_a_hit_spends_nothing_and_saves_its_entrys_full_compile(info, saved):
    assert on_hit(info) == CompileSeconds(0.0, saved)


def test_the_totals_add_up_and_name_units_without_a_basis():
    assert total([CompileSeconds(2.0, 0.0), CompileSeconds(0.0, 40.0), CompileSeconds(3.0, 37.0)]).describe() == \
        "compile seconds spent 5.0, saved 77.0"
    assert total([CompileSeconds(0.0, 40.0), CompileSeconds(0.0, None)]).describe() == \
        "compile seconds spent 0.0, saved 40.0 (n/a for 1 units)"
    assert total([CompileSeconds(3.0, None)]).describe() == "compile seconds spent 3.0, saved n/a"
    assert total([]).describe() == "compile seconds spent 0.0, saved 0.0"


def test_the_seconds_travel_with_the_entry_through_both_tiers(tmp_path):
    first = BuildCache(tmp_path / "w1", RemoteTier(LocalStore(tmp_path / "shared"), "build-cache"))
    first.put("batch", "k1", FILES, {"unit": "u"} | entry_info(12.5, 12.5))
    local = first.get("batch", "k1")
    assert local is not None and on_hit(local.info) == CompileSeconds(0.0, 12.5)
    # another worker, its own empty local tier: the shared tier's entry brings the seconds
    second = BuildCache(tmp_path / "w2", RemoteTier(LocalStore(tmp_path / "shared"), "build-cache"))
    remote = second.get("batch", "k1")
    assert remote is not None and remote.files == FILES and on_hit(remote.info) == CompileSeconds(0.0, 12.5)
    kept = BuildCache(tmp_path / "w2").get("batch", "k1")  # now in its local tier, seconds included
    assert kept is not None and on_hit(kept.info) == CompileSeconds(0.0, 12.5)


def test_an_entry_written_before_seconds_were_recorded_is_a_hit_with_no_saved_seconds(tmp_path):
    cache = BuildCache(tmp_path)
    cache.put("batch", "old", FILES, {"unit": "u", "toolchain": {}})  # what builds wrote until now
    hit = cache.get("batch", "old")
    assert hit is not None and hit.files == FILES and on_hit(hit.info) == CompileSeconds(0.0, None)


def test_a_units_last_full_compile_is_kept_across_keys(tmp_path):
    cache = BuildCache(tmp_path)
    assert cache.full_compile_seconds("build/cu130/sm_90/k/k") is None
    cache.note_full_compile("build/cu130/sm_90/k/k", 40.25)
    assert cache.full_compile_seconds("build/cu130/sm_90/k/k") == 40.25
    assert cache.full_compile_seconds("build/cu130/sm_80/k/k") is None
    damaged = next((tmp_path / "unit-seconds").iterdir())
    damaged.write_text("{not json")
    assert cache.full_compile_seconds("build/cu130/sm_90/k/k") is None  # no basis, never an error


def _result(cache: str, stats: CompileStats | None, seconds: CompileSeconds) -> UnitResult:
    return UnitResult("u", cache, 1.0, (), (), 10, compile=stats, seconds=seconds)  # type: ignore[arg-type]


def test_the_compile_line_ends_with_the_seconds_spent_and_saved():
    outcomes = {"a": _result("miss", CompileStats(("a.cu",), ("b.cu",)), CompileSeconds(2.0, 30.0)),
                "b": _result("hit", None, CompileSeconds(0.0, 40.0)), "c": _result("miss", None, CompileSeconds(1.5))}
    assert compile_line(outcomes) == ("Compile: 1 of 2 translation units compiled, 1 reused from the compile cache, "  # type: ignore[arg-type]
                                      "in 1 native units; compile seconds spent 3.5, saved 70.0.")
    warm = {"b": _result("hit", None, CompileSeconds(0.0, 40.0))}
    assert compile_line(warm) == ("Compile: no native unit compiled (every one served by the unit cache, or none "  # type: ignore[arg-type]
                                  "planned); compile seconds spent 0.0, saved 40.0.")


needs_toolchain = pytest.mark.skipif(shutil.which("nvcc") is None or open_compile_cache(Path("/nonexistent/x"))
                                     is None, reason="nvcc or ccache is not installed")
UNIT = "build/cu130/sm_90/multicu/multicu"


def _build(config: Path, out: Path) -> tuple[RunManifest, str, dict[str, Any]]:
    """A real build: its run record, and the compile line and unit row it showed in the Prefect UI."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from kiln.flows.build import build_flow

    state = build_flow(str(config), str(out), version="0.1.0.dev20261206", return_state=True)
    assert state.is_completed(), state.message
    run_id = state.state_details.flow_run_id
    mine = ArtifactFilter(key=ArtifactFilterKey(any_=["kiln-build", "kiln-build-cache"]),
                          flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    with get_client(sync_client=True) as client:
        found = {a.key: a.data for a in client.read_artifacts(artifact_filter=mine)}
    line = next(line for line in str(found["kiln-build-cache"]).splitlines() if line.startswith("Compile:"))
    row = next(r for r in json.loads(str(found["kiln-build"])) if r["unit"] == UNIT)
    return RunManifest.load(out / str(run_id)), line, row


@pytest.mark.slow
@needs_toolchain
def test_a_second_build_spends_no_compile_seconds_and_saves_what_the_first_recorded(prefect_server, tmp_path):
    config = copy_project("multicu", tmp_path)
    run, line, row = _build(config, tmp_path / "cold")
    assert next(u for u in run.units if u.id == UNIT).cache == "miss"
    entries = [json.loads(p.read_text()) for p in (config.parent).rglob("entries/*/*.json")]
    recorded = next(e["info"] for e in entries if e["info"].get("unit") == UNIT)
    assert recorded[FULL] > 0 and recorded["compile_s"] == recorded[FULL]
    assert row["compile_s"] == round(recorded[FULL], 2) and row["saved_s"] == 0
    assert "; compile seconds spent " in line and line.endswith(", saved 0.0.")

    run, line, row = _build(config, tmp_path / "warm")
    assert next(u for u in run.units if u.id == UNIT).cache == "hit"
    assert row["compile_s"] == 0 and row["saved_s"] == round(recorded[FULL], 2)
    assert line.endswith(f"; compile seconds spent 0.0, saved {recorded[FULL]:.1f}.")
