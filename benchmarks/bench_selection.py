"""Test selection on the default project: what a nightly runs after a documentation-only commit and after a
one-kernel change, against the same nightly with ``--full`` (every test, today's behaviour without selection).

    python benchmarks/bench_selection.py [--rounds 2] [--work DIR]

A clone of this checkout (the default project: ``kiln.toml`` at its root) gets one warm-up nightly, then each
round makes a commit and runs its nightly twice, selected and ``--full``, in alternating order (so load drifts
hit both alike): a README edit (no byte of the wheel or of any test changes) and an edit of one Triton kernel
module (``kernels/kiln_kernels/_quant_tl.py``, which only the quantization tests import, lazily). It prints per
nightly the tests run and carried (from the run's suite reports), the test stage's wall (first test unit's
start to the last one's end) and the nightly's whole wall, and the medians per case with their ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.core.manifest import RunManifest
from kiln.tasks.testing.selection import CARRIED

REPO = Path(__file__).resolve().parents[1]
KILN = [sys.executable, "-m", "kiln.flows.cli"]
TIMEOUT_S = 1800


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, timeout=120, capture_output=True)


def _nightly(root: Path, full: bool) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run([*KILN, "nightly", "--out", "out", *(["--full"] if full else [])], cwd=root,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: a unit failed (a GPU suite not run is not that); the record still holds
        raise SystemExit(f"kiln nightly failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    view = root / "out" / "latest"
    tests = [u for u in RunManifest.load(view).units if u.stage == "test" and not u.id.endswith("/recall")]
    ran = carried = 0
    for report in (view / "tests").glob("*.json"):
        for test in json.loads(report.read_text()).get("tests", []):
            if test["outcome"] == "skipped":
                continue
            if str(test.get("message", "")).startswith(CARRIED):
                carried += 1
            else:
                ran += 1
    units_s = sum(u.duration_s or 0.0 for u in tests)
    return {"wall_s": wall, "test_units_s": units_s, "ran": ran, "carried": carried}


def _round(root: Path, case: str, n: int, results: dict[str, list[dict[str, float]]]) -> None:
    if case == "docs":
        (root / "README.md").write_text((root / "README.md").read_text() + f"\nA note of round {n}.\n")
    else:
        kernel = root / "kernels" / "kiln_kernels" / "_quant_tl.py"
        kernel.write_text(kernel.read_text() + f"\n# round {n}: a change to one Triton kernel's module\n")
    _git(root, "commit", "-qam", f"{case} change, round {n}")
    order = (False, True) if n % 2 == 0 else (True, False)
    for full in order:
        results[f"{case}{' --full' if full else ''}"].append(_nightly(root, full))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    ns = parser.parse_args()
    work = ns.work or Path(tempfile.mkdtemp(prefix="kiln-bench-selection-"))
    root = work / "kiln"
    if root.exists():
        shutil.rmtree(root)
    subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True, timeout=600)
    warm = _nightly(root, full=True)
    print(f"warm-up nightly: {warm}")
    results: dict[str, list[dict[str, float]]] = {k: [] for k in ("docs", "docs --full", "kernel", "kernel --full")}
    for n in range(ns.rounds):
        for case in ("docs", "kernel"):
            _round(root, case, n, results)
    print(f"{'case':<15} {'tests run':>9} {'carried':>8} {'test units s':>13} {'nightly s':>10}")
    medians = {}
    for case, rows in results.items():
        medians[case] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        m = medians[case]
        print(f"{case:<15} {m['ran']:>9.0f} {m['carried']:>8.0f} {m['test_units_s']:>13.1f} {m['wall_s']:>10.1f}")
    for case in ("docs", "kernel"):
        sel, full = medians[case], medians[f"{case} --full"]
        print(f"{case}: selected / --full: test units {sel['test_units_s'] / full['test_units_s']:.2f}x, "
              f"nightly {sel['wall_s'] / full['wall_s']:.2f}x, tests run {sel['ran']:.0f} of "
              f"{full['ran']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
