"""What test isolation costs: plain pytest vs Kiln's fork server vs a fresh interpreter per test.

    python benchmarks/bench_isolation.py [--suite tests/kernels] [--markers "not gpu and not slow"]
                                         [--repeats 3] [--fresh-sample 16] [--json out.json]

For each method the wall time of the whole suite is measured ``--repeats``
times (median reported):

* ``plain``: one ``python -m pytest`` process for the suite (the baseline);
* ``kiln per test``: :func:`kiln.tasks.testing.runner.run_tests` with ``isolate="test"``
  (fork server; includes starting it, preloading and collecting);
* ``kiln per file``: the same with ``isolate="file"``;
* ``fresh per test``: ``python -m pytest NODEID`` for every test, the spawn
  baseline. It costs seconds per test, so ``--fresh-sample N`` times N evenly
  spaced tests and scales the mean to the suite (0: every test).

Per-test start cost = (method wall − the tests' own time under plain pytest)
/ number of tests, where the tests' own time is the sum of the testcase times
of plain pytest's JUnit report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln.tasks.testing.jobs import PRELOAD, RunOptions  # noqa: E402
from kiln.tasks.testing.runner import run_tests  # noqa: E402

TIMEOUT_S = 1800


def _pytest(args: list[str], junit: Path | None = None) -> float:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if junit is not None:
        cmd += ["--junitxml", str(junit)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 5):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def plain(suite: str, markers: str) -> tuple[float, float, int]:
    """(wall, sum of test times, tests) of one plain pytest run."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "plain.xml"
        wall = _pytest([suite, "-m", markers], junit)
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    return wall, sum(float(c.get("time", 0)) for c in cases), len(cases)


def kiln(suite: str, markers: str, isolate: str, preload: tuple[str, ...]) -> tuple[float, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results = run_tests([suite], REPO, tmp, RunOptions(isolate=isolate, markers=markers, preload=preload))  # type: ignore[arg-type]
        wall = time.perf_counter() - start
    bad = [f"{r.nodeid}: {r.outcome}" for r in results if r.outcome not in ("passed", "skipped")]
    if bad:
        print(f"warning: {len(bad)} tests did not pass under isolate={isolate}: {bad[:3]}", file=sys.stderr)
    return wall, [r.nodeid for r in results]


def fresh(nodeids: list[str], sample: int) -> tuple[float, int]:
    """Estimated wall of running every test in its own fresh interpreter; (estimate, tests timed)."""
    if sample <= 0 or sample >= len(nodeids):
        chosen = nodeids
    else:
        step = len(nodeids) / sample
        chosen = [nodeids[int(i * step)] for i in range(sample)]
    times = [_pytest([nodeid]) for nodeid in chosen]
    return statistics.mean(times) * len(nodeids), len(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="tests/kernels")
    parser.add_argument("--markers", default="not gpu and not slow")
    parser.add_argument("--preload", action="append", default=None,
                        help="modules the fork server imports (default: Kiln's defaults plus 'kiln_kernels')")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh-sample", type=int, default=16)
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args()
    preload = tuple(ns.preload) if ns.preload else (*PRELOAD, "kiln_kernels")
    os.environ.setdefault("KILN_GPU_COUNT", "0")  # benchmark the CPU suite even on a GPU machine

    runs: dict[str, list[float]] = {"plain": [], "kiln per test": [], "kiln per file": [], "fresh per test": []}
    own, count, fresh_timed = [], 0, 0
    for repeat in range(ns.repeats):
        wall, test_time, count = plain(ns.suite, ns.markers)
        runs["plain"].append(wall)
        own.append(test_time)
        wall, nodeids = kiln(ns.suite, ns.markers, "test", preload)
        runs["kiln per test"].append(wall)
        runs["kiln per file"].append(kiln(ns.suite, ns.markers, "file", preload)[0])
        estimate, fresh_timed = fresh(nodeids, ns.fresh_sample)
        runs["fresh per test"].append(estimate)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in runs.items()), file=sys.stderr)

    base, tests_own = statistics.median(runs["plain"]), statistics.median(own)
    rows = []
    for method, walls in runs.items():
        median = statistics.median(walls)
        rows.append(
            {
                "method": method,
                "median_s": round(median, 2),
                "runs_s": [round(w, 2) for w in walls],
                "vs_plain": round(median / base, 2),
                "vs_fresh": round(median / statistics.median(runs["fresh per test"]), 3),
                "start_cost_per_test_ms": round(1000 * (median - tests_own) / max(count, 1), 1),
            }
        )
    print(f"suite {ns.suite} (-m '{ns.markers}'): {count} tests; their own time under plain pytest {tests_own:.2f}s; "
          f"fresh per test timed on {fresh_timed} tests and scaled; {ns.repeats} repeats; "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")
    print("| method | median wall (s) | runs (s) | × plain | × fresh per test | start cost per test (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['median_s']} | {', '.join(map(str, r['runs_s']))} | {r['vs_plain']} | "
              f"{r['vs_fresh']} | {r['start_cost_per_test_ms']} |")
    if ns.json:
        ns.json.write_text(json.dumps({"suite": ns.suite, "tests": count, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
