"""The build caches on a multi-file CUDA library: cold, a one-file change, and a second worker.

The project is tests/fixtures/projects/multicu (three ``.cu`` and one ``.cpp`` translation units of one
library, nvcc for sm_90), built by the build stage's own functions (plan, units, wheel) in this process.
Each repeat, in fresh directories:

- ``cold``: worker A, empty unit cache, empty compile cache, empty shared tier;
- ``one_file``: worker A after a one-line change in one ``.cu``: the unit misses, ccache compiles that
  translation unit alone and links;
- ``one_file_no_compile_cache``: the same change on a copy of worker A's state with the compile cache
  turned off (the baseline: what a one-file change cost before), measured in the same repeat;
- ``second_worker``: worker B, a fresh clone with an empty local cache and an empty compile cache, sharing
  only worker A's shared tier (``[build.cache] remote``, here a ``file://`` store): it compiles nothing;
- ``add_arch``: the kernel declared for sm_80 and sm_90, worker C built the variant for ``["8.0"]``, then
  the variant gains ``"9.0"``: the unit misses, each ``.cu``'s sm_90 device code compiles and sm_80's is
  served by ccache (Kiln's nvcc units compile one arch per nvcc call);
- ``add_arch_cold``: the baseline, the variant built for ``["8.0", "9.0"]`` from empty caches, in the same
  repeat.

The summary gives each median and its ratio to ``cold``; translation units compiled per measurement and the
shared tier's traffic (entries served, objects written) are reported beside them.

Usage::

    python benchmarks/bench_compile_cache.py [--repeats 3] [--only add_arch]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "projects" / "multicu"


def build(config: Path, cache: Path, shared: Path, out: Path, compile_cache: bool = True) -> dict:
    """One build of ``config``'s project; its wall time, unit cache states and translation units compiled."""
    from kiln.core.store import LocalStore
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import build_unit
    from kiln.tasks.project.config import load_config

    start = time.perf_counter()
    loaded = load_config(config)
    loaded = loaded.model_copy(update={"build": loaded.build.model_copy(update={
        "cache": loaded.build.cache.model_copy(update={"remote": "artifacts"})})})
    setup = prepare_build(loaded, "0.1.0", None, cache_dir=str(cache), store=LocalStore(shared))
    if not compile_cache and setup.nvcc is not None:
        setup = dataclasses.replace(setup, nvcc=dataclasses.replace(setup.nvcc, cache=None))
    outcomes = {}
    with compile_context(setup, out, jobs=1) as env:
        for unit in setup.plan.units:
            outcomes[unit.id] = build_unit(unit, env)
    for variant in setup.plan.variants:
        assemble_variant(setup, variant, outcomes, out)
    seconds = time.perf_counter() - start
    compiled = sum(len(r.compile.compiled) for r in outcomes.values() if r.compile is not None)
    reused = sum(len(r.compile.reused) for r in outcomes.values() if r.compile is not None)
    tier = setup.remote.stats.as_dict() if setup.remote is not None else {}
    return {"s": seconds, "units": [r.cache for r in outcomes.values()], "tu_compiled": compiled,
            "tu_reused": reused, "shared": tier}


def clone(dest: Path) -> Path:
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    return dest / "kiln.toml"


def edit(config: Path) -> None:
    shift = config.parent / "multicu" / "csrc" / "shift.cu"
    shift.write_text(shift.read_text().replace("x[i] += b", "x[i] += 2.0f * b"))


def set_archs(config: Path, archs: list[str]) -> None:
    """The variant builds ``archs``; the fixture's kernel is declared for sm_80 and sm_90."""
    registry = config.parent / "multicu" / "registry.py"
    registry.write_text(registry.read_text().replace('ARCHS = ("9.0",)', 'ARCHS = ("8.0", "9.0")'))
    toml = config.read_text()
    start = toml.index("archs = [")
    config.write_text(toml[:start] + "archs = " + json.dumps(archs) + toml[toml.index("\n", start):])


def repeat_add_arch(root: Path) -> dict[str, dict]:
    worker = clone(root / "worker-c")
    set_archs(worker, ["8.0"])
    build(worker, root / "cache-c", root / "shared-c", root / "out-c-one-arch")
    set_archs(worker, ["8.0", "9.0"])
    results = {"add_arch": build(worker, root / "cache-c", root / "shared-c", root / "out-c-added")}
    fresh = clone(root / "worker-d")
    set_archs(fresh, ["8.0", "9.0"])
    results["add_arch_cold"] = build(fresh, root / "cache-d", root / "shared-d", root / "out-d")
    same = [sorted(p.read_bytes() for p in (root / out).rglob("*.whl")) for out in ("out-c-added", "out-d")]
    results["add_arch"]["wheels_identical_to_cold"] = same[0] == same[1] and bool(same[0])
    return results


def repeat(root: Path) -> dict[str, dict]:
    shared = root / "shared-tier"
    first = clone(root / "worker-a")
    results = {"cold": build(first, root / "cache-a", shared, root / "out-a-cold")}
    baseline = root / "worker-a-copy"
    shutil.copytree(first.parent, baseline)
    shutil.copytree(root / "cache-a", root / "cache-a-copy")
    edit(first)
    results["one_file"] = build(first, root / "cache-a", shared, root / "out-a-one")
    edit(baseline / "kiln.toml")
    results["one_file_no_compile_cache"] = build(baseline / "kiln.toml", root / "cache-a-copy", root / "unshared",
                                                 root / "out-a-base", compile_cache=False)
    second = clone(root / "worker-b")
    results["second_worker"] = build(second, root / "cache-b", shared, root / "out-b")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["add_arch"], help="measure the added-arch case alone")
    args = parser.parse_args()
    runs = []
    for number in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="kiln-bench-cc-") as tmp:
            runs.append({} if args.only else repeat(Path(tmp)))
        with tempfile.TemporaryDirectory(prefix="kiln-bench-cc-arch-") as tmp:
            runs[-1] |= repeat_add_arch(Path(tmp))
        print(f"repeat {number + 1}: " + json.dumps({k: round(v["s"], 2) for k, v in runs[-1].items()}), flush=True)
    cold = statistics.median(r["cold" if "cold" in r else "add_arch_cold"]["s"] for r in runs)
    summary = {"machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
               "python": platform.python_version(), "repeats": args.repeats, "medians_s": {}, "ratio_to_cold": {}}
    for name in runs[0]:
        median = statistics.median(r[name]["s"] for r in runs)
        summary["medians_s"][name] = round(median, 2)
        summary["ratio_to_cold"][name] = round(median / cold, 3)
        last = runs[-1][name]
        summary[name] = {"units": last["units"], "tu_compiled": last["tu_compiled"], "tu_reused": last["tu_reused"],
                         "shared_tier": last["shared"]}
    if "one_file" in summary["medians_s"]:
        summary["one_file_vs_no_compile_cache"] = round(
            summary["medians_s"]["one_file"] / summary["medians_s"]["one_file_no_compile_cache"], 3)
    summary["add_arch_vs_cold"] = round(summary["medians_s"]["add_arch"] / summary["medians_s"]["add_arch_cold"], 3)
    summary["add_arch_wheels_identical_to_cold"] = all(r["add_arch"]["wheels_identical_to_cold"] for r in runs)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
