"""The per-translation-unit compile cache (ccache) of Kiln's nvcc units, on a real nvcc and a four-file
library: a warm rebuild compiles nothing, a one-file change compiles that file alone, a clone at another
path hits, and the library's bytes are the same whether the cache hit or not."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import CompileError
from kiln.core.manifest import RunManifest
from kiln.tasks.build.compile_cache import CompileStats, compile_cache_dir, open_compile_cache, read_stats_log
from kiln.tasks.build.nvcc import build_library_counted, find_nvcc
from kiln.tasks.build.stage import cache_report, compile_line, unit_cache_state
from kiln.tasks.build.units import UnitResult
from tests.helpers.projects import copy_project

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "projects" / "multicu" / "multicu" / "csrc"
SOURCES = ("scale.cu", "shift.cu", "square.cu", "api.cpp")
ARCHS = ("9.0",)
# each .cu compiles once per arch, labelled with its arch; api.cpp has no device code and compiles once
LABELS = ("scale.cu [sm_90]", "shift.cu [sm_90]", "square.cu [sm_90]", "api.cpp")

needs_toolchain = pytest.mark.skipif(shutil.which("nvcc") is None or open_compile_cache(Path("/nonexistent/x"))
                                     is None, reason="nvcc or ccache is not installed")


def test_the_stats_log_counts_compiled_and_reused_translation_units(tmp_path):
    log = tmp_path / "stats.log"
    log.write_text("# a.cu\ncache_miss\ndirect_cache_miss\nlocal_storage_write\n"
                   "# b.cu\ndirect_cache_hit\nlocal_storage_hit\n# c.cpp\npreprocessed_cache_hit\n")
    assert read_stats_log(log) == CompileStats(("a.cu",), ("b.cu", "c.cpp"))
    assert read_stats_log(tmp_path / "none.log") == CompileStats()
    assert read_stats_log(log).describe() == "1 of 3 translation units compiled, 2 reused"


def test_the_compile_cache_lives_in_the_unit_cache_directory(tmp_path):
    assert compile_cache_dir(tmp_path / "cache") == tmp_path / "cache" / "ccache"


def _clone(dest: Path) -> list[Path]:
    shutil.copytree(FIXTURE, dest)
    return [dest / name for name in SOURCES]


def _build(sources: list[Path], cache_root: Path | None) -> tuple[bytes, CompileStats]:
    cache = open_compile_cache(cache_root) if cache_root is not None else None
    return build_library_counted(find_nvcc(), sources, "libmulticu.so", ARCHS, timeout=600, cache=cache)


@pytest.mark.slow
@needs_toolchain
def test_one_changed_file_compiles_alone_and_every_library_is_the_same_hit_or_not(tmp_path):
    cache = tmp_path / "cache"
    cold, stats = _build(_clone(tmp_path / "first" / "csrc"), cache)
    assert sorted(stats.compiled) == sorted(LABELS) and stats.reused == ()

    # another clone, at a path of another length: every translation unit is served, the bytes are the same
    second = _clone(tmp_path / "a-much-longer-second-clone-path" / "csrc")
    warm, stats = _build(second, cache)
    assert stats.compiled == () and sorted(stats.reused) == sorted(LABELS)
    assert warm == cold

    # one .cu changes: it alone is compiled; the library equals one built with no cache at all
    shift = second[1]
    shift.write_text(shift.read_text().replace("x[i] += b", "x[i] += 2.0f * b"))
    changed, stats = _build(second, cache)
    assert stats.compiled == ("shift.cu [sm_90]",)
    assert sorted(stats.reused) == ["api.cpp", "scale.cu [sm_90]", "square.cu [sm_90]"]
    assert changed != cold
    uncached, stats = _build(second, None)
    assert uncached == changed and len(stats.compiled) == 4


def _flow_build(config: Path, out: Path) -> tuple[Any, RunManifest]:
    from kiln.flows.build import build_flow

    state = build_flow(str(config), str(out), version="0.1.0.dev20261206", return_state=True)
    return state, RunManifest.load(out / str(state.state_details.flow_run_id))


@pytest.mark.slow
@needs_toolchain
def test_a_build_compiles_only_the_changed_translation_unit_and_nothing_for_a_python_change(prefect_server,
                                                                                           tmp_path):
    config = copy_project("multicu", tmp_path)
    unit_id = "build/cu130/sm_90/multicu/multicu"
    state, run = _flow_build(config, tmp_path / "cold")
    unit = next(u for u in run.units if u.id == unit_id)
    assert state.is_completed() and unit.cache == "miss"
    assert "4 of 4 compilations (translation unit × arch) compiled, 0 reused" in unit.message

    shift = config.parent / "multicu" / "csrc" / "shift.cu"
    shift.write_text(shift.read_text().replace("x[i] += b", "x[i] += 2.0f * b"))
    state, run = _flow_build(config, tmp_path / "one-file")
    unit = next(u for u in run.units if u.id == unit_id)
    assert state.is_completed() and unit.cache == "miss"
    assert "1 of 4 compilations (translation unit × arch) compiled, 3 reused" in unit.message  # ccache's own statistics

    init = config.parent / "multicu" / "__init__.py"
    init.write_text(init.read_text() + "\nDOC = 'a Python change'\n")
    state, run = _flow_build(config, tmp_path / "python")
    unit = next(u for u in run.units if u.id == unit_id)
    # The kernel's module is part of the unit's key, so the unit runs again; no compiler does.
    assert state.is_completed() and "0 of 4 compilations (translation unit × arch) compiled, 4 reused" in unit.message


def _result(cache: str, stats: CompileStats | None) -> UnitResult:
    return UnitResult("build/cu130/sm_90/k/k", cache, 1.0, (), (), 10, compile=stats)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cache", "stats", "shown"), [
    ("hit", None, "hit"),
    ("miss", None, "miss"),  # a unit without translation units (Triton)
    ("miss", CompileStats(("a.cu", "b.cu"), ()), "miss"),
    ("miss", CompileStats(("a.cu",), ("b.cu", "c.cu", "d.cpp")), "partial (1 of 4)"),
    ("miss", CompileStats((), ("a.cu", "b.cu")), "partial (0 of 2)"),
])
def test_each_unit_shows_hit_partial_or_miss(cache, stats, shown):
    assert unit_cache_state(_result(cache, stats)) == shown


def test_the_build_summary_has_a_compile_line():
    outcomes = {"a": _result("miss", CompileStats(("a.cu",), ("b.cu", "c.cu"))),
                "b": _result("miss", CompileStats(("x.cu",), ())), "c": _result("hit", None),
                "d": CompileError("nvcc failed")}
    line = compile_line(outcomes)  # type: ignore[arg-type]
    assert line == ("Compile: 2 of 4 translation units compiled, 2 reused from the compile cache, in 2 native units; "
                    "compile seconds spent 0.0, saved 0.0.")
    assert line in cache_report([], line)
    per_arch = {"a": _result("miss", CompileStats(("a.cu [sm_90]",), ("a.cu [sm_80]", "api.cpp")))}
    assert compile_line(per_arch) == ("Compile: 1 of 3 compilations (translation unit × arch) compiled, 2 reused "  # type: ignore[arg-type]
                                      "from the compile cache, in 1 native units; compile seconds spent 0.0, saved 0.0.")
