"""The compile cache under a package's own build (pep517): cold, a second clone, a one-file change.

The project is tests/fixtures/projects/cmulti (a setuptools C extension of three translation units), each
``.c`` file grown by ``--functions`` generated functions so that compiling is a measurable part of the build
(0: the fixture as it is). Its cpu unit is built by the build stage's own functions (plan, unit, its
sandboxed ``pip wheel``) in this process. Each repeat, in fresh directories:

- ``cold``: clone A, empty unit cache, empty compile cache: every translation unit compiles;
- ``second_clone``: clone B at another path, a fresh unit cache holding only clone A's compile cache
  (``<cache_dir>/ccache`` copied, as a worker given that cache): the unit misses, ccache serves every
  translation unit; the wheel is checked byte-identical to A's;
- ``one_file``: clone B after a one-line change in ``mul.c``: that translation unit alone compiles;
- ``one_file_no_compile_cache``: the same change with the compile cache turned off, in a fresh cache (the
  baseline: what a one-file change of a pep517 unit cost before), measured in the same repeat.

The summary gives each median and its ratio to ``cold``, and the translation units compiled per measurement.

Usage::

    python benchmarks/bench_compile_cache_pep517.py [--repeats 3] [--functions 600]
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "projects" / "cmulti"


def grow(project: Path, functions: int) -> None:
    """Append ``functions`` generated functions to each ``.c`` file (the same text in every clone)."""
    for number, name in enumerate(("add.c", "mul.c", "module.c")):
        body = "".join(f"long cmulti_gen_{number}_{i}(long x) {{ long s = {i}; for (long k = 0; k < x; k++) "
                       f"s += (k * {i + 3}) ^ (s >> {i % 7 + 1}); return s; }}\n" for i in range(functions))
        path = project / "csrc" / name
        path.write_text(path.read_text() + body)


def clone(dest: Path, functions: int) -> Path:
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    grow(dest, functions)
    return dest


def build(project: Path, cache: Path, out: Path, compile_cache: bool = True) -> dict:
    """One build of the project's cpu unit; its wall time, translation units compiled and reused, its wheel."""
    from kiln.tasks.build.stage import compile_context, prepare_build
    from kiln.tasks.build.units import build_unit

    start = time.perf_counter()
    setup = prepare_build(str(project / "kiln.toml"), "1.0.0", None, cache_dir=str(cache))
    if not compile_cache and setup.project is not None:
        setup = dataclasses.replace(setup, project=dataclasses.replace(setup.project, compile_cache=None))
    (unit,) = setup.plan.units
    with compile_context(setup, out) as context:
        result = build_unit(unit, context)
    seconds = time.perf_counter() - start
    (wheel,) = [f for f in result.files if f.name.endswith(".whl")]
    stats = result.compile
    return {"s": seconds, "unit": result.cache, "tu_compiled": len(stats.compiled) if stats else None,
            "tu_reused": len(stats.reused) if stats else None, "wheel": wheel.read_bytes()}


def repeat(root: Path, functions: int) -> dict[str, dict]:
    first = clone(root / "worker-a", functions)
    results = {"cold": build(first, root / "cache-a", root / "out-a")}
    second = clone(root / "worker-b-at-a-longer-path", functions)
    shutil.copytree(root / "cache-a" / "ccache", root / "cache-b" / "ccache")
    results["second_clone"] = build(second, root / "cache-b", root / "out-b")
    if results["second_clone"]["wheel"] != results["cold"]["wheel"]:
        raise SystemExit("the second clone's wheel differs from the first's: the compile cache changed its bytes")
    mul = second / "csrc" / "mul.c"
    mul.write_text(mul.read_text().replace("return a * b;", "return b * a + 0 * a;"))
    results["one_file"] = build(second, root / "cache-b", root / "out-c")
    results["one_file_no_compile_cache"] = build(second, root / "cache-plain", root / "out-d", compile_cache=False)
    if results["one_file"]["wheel"] != results["one_file_no_compile_cache"]["wheel"]:
        raise SystemExit("the one-file change's wheel differs with and without the compile cache")
    return results


def repeated(one: Callable[[Path, int], dict[str, dict]], repeats: int, size: int,
             prefix: str) -> list[dict[str, dict]]:
    """``repeats`` runs of ``one(folder, size)``, each in a fresh temporary folder and printed as it ends."""
    runs = []
    for number in range(repeats):
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            runs.append(one(Path(tmp), size))
        print(f"repeat {number + 1}: " + json.dumps({k: round(v["s"], 2) for k, v in runs[-1].items()}), flush=True)
    return runs


def medians(runs: list[dict[str, dict]], summary: dict) -> dict:
    """``summary`` with each measurement's median and its ratio to ``cold``'s."""
    cold = statistics.median(r["cold"]["s"] for r in runs)
    summary |= {"medians_s": {}, "ratio_to_cold": {}}
    for name in runs[0]:
        median = statistics.median(r[name]["s"] for r in runs)
        summary["medians_s"][name] = round(median, 2)
        summary["ratio_to_cold"][name] = round(median / cold, 3)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--functions", type=int, default=600, help="generated functions added to each .c file")
    args = parser.parse_args()
    runs = repeated(repeat, args.repeats, args.functions, "kiln-bench-cc517-")
    summary = medians(runs, {"machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
                             "python": platform.python_version(), "repeats": args.repeats,
                             "functions": args.functions})
    summary["tu"] = {name: {"compiled": runs[-1][name]["tu_compiled"], "reused": runs[-1][name]["tu_reused"]}
                     for name in runs[0]}
    summary["one_file_vs_no_compile_cache"] = round(
        summary["medians_s"]["one_file"] / summary["medians_s"]["one_file_no_compile_cache"], 3)
    summary["wheels_identical"] = "second clone = cold; one file with = without the compile cache (checked)"
    print(json.dumps(summary, indent=2))

if __name__ == "__main__":
    main()
