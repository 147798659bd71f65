"""The Python matrix's build: one 4-Python matrix build of the C fixture vs four one-Python builds.

The fixture is ``tests/fixtures/projects/cmatrix`` (a CPython C-API extension, no torch), copied into a
snapshot per configuration: the matrix (``python = ["3.10", "3.11", "3.12", "3.13"]``) and four single-Python
projects (``python = ["3.1x"]``). Every build runs in a fresh process (``--one``): the build stage's own
functions (plan, one unit per cell in threads, one wheel per cell), as ``kiln build`` runs them without
Prefect. Measured per repeat, in this order, every timing the process's wall time (start to exit):

- ``cold``: the matrix with an empty build cache, then the four single builds one after another, each with
  an empty cache (the same work as four separate CI jobs on one machine); a cold build makes each cell's build
  environment (uv's and pip's own download caches stay warm, as on a CI runner with a cache);
- ``warm``: each again with the cache the cold build left: the unchanged matrix, and one single build (3.12);
- ``one cell changed``: the cache of a 3-Python matrix (3.10-3.12) is warmed, then the matrix gains 3.13:
  the run reports each unit's cache hit or miss (only the new cell should build).

Usage::

    python benchmarks/bench_matrix.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "projects" / "cmatrix"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
AXIS = 'python = ["3.10", "3.11", "3.12", "3.13"]'
TIMEOUT_S = 1800


def one(config: str, cache: str, out: str) -> dict[str, object]:
    """One build in this process: every unit of the plan (threads), then every cell's wheel."""
    sys.path.insert(0, str(REPO))
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import build_unit

    setup = prepare_build(config, "1.0.0", None, cache_dir=cache)
    with compile_context(setup, out) as context, ThreadPoolExecutor(setup.config.build.jobs) as threads:
        results = dict(threads.map(lambda u: (u.id, build_unit(u, context)), setup.plan.units))
    states = [assemble_variant(setup, v, dict(results), out).unit.state for v in setup.plan.variants]  # type: ignore[arg-type]
    return {"units": {uid: r.cache for uid, r in results.items()}, "wheels": states}


def _project(root: Path, axis: str) -> Path:
    project = root / "cmatrix"
    shutil.copytree(FIXTURE, project, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    toml = project / "kiln.toml"
    toml.write_text(toml.read_text().replace(AXIS, axis))
    return toml


def _timed(config: Path, cache: Path, out: Path) -> tuple[float, dict[str, object]]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--one", str(config), str(cache), str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"build of {config} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if set(result["wheels"]) != {"completed"}:
        raise SystemExit(f"build of {config}: a wheel was not built: {result}")
    return wall, result


def repeat(root: Path) -> dict[str, object]:
    matrix = _project(root / "matrix", AXIS)
    singles = {p: _project(root / f"py{p}", f'python = ["{p}"]') for p in PYTHONS}
    cold_matrix, _ = _timed(matrix, root / "matrix" / "cache", root / "matrix" / "out")
    cold_singles = [_timed(c, root / f"py{p}" / "cache", root / f"py{p}" / "out")[0] for p, c in singles.items()]
    warm_matrix, warm = _timed(matrix, root / "matrix" / "cache", root / "matrix" / "out2")
    warm_single, _ = _timed(singles["3.12"], root / "py3.12" / "cache", root / "py3.12" / "out2")
    grown = _project(root / "grown", 'python = ["3.10", "3.11", "3.12"]')
    _timed(grown, root / "grown" / "cache", root / "grown" / "out")
    grown.write_text(grown.read_text().replace('python = ["3.10", "3.11", "3.12"]', AXIS))
    changed, after = _timed(grown, root / "grown" / "cache", root / "grown" / "out2")
    return {"cold_matrix_s": cold_matrix, "cold_four_singles_s": sum(cold_singles), "cold_singles_s": cold_singles,
            "warm_matrix_s": warm_matrix, "warm_single_s": warm_single, "warm_units": warm["units"],
            "one_cell_added_s": changed, "one_cell_added_units": after["units"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("CONFIG", "CACHE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    runs = []
    for index in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="kiln-bench-matrix-") as tmp:
            runs.append(repeat(Path(tmp)))
        print(json.dumps({"repeat": index + 1, **runs[-1]}), flush=True)

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)  # type: ignore[arg-type]

    summary = {key: round(median(key), 2) for key in ("cold_matrix_s", "cold_four_singles_s", "warm_matrix_s",
                                                       "warm_single_s", "one_cell_added_s")}
    summary["cold_ratio_singles_over_matrix"] = round(median("cold_four_singles_s") / median("cold_matrix_s"), 2)
    summary["warm_ratio_matrix_over_single"] = round(median("warm_matrix_s") / median("warm_single_s"), 2)
    print(json.dumps({"machine": f"{platform.node()} {platform.machine()}", "repeats": args.repeats,
                      "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
