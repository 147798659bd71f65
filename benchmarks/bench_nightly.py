"""Cold ``kiln nightly`` of the default project, end to end, beside a warm one in the same run.

Each repeat clones the repository afresh (an empty build cache, no stored
plans, no earlier run) and times ``kiln nightly --out out`` there, process
start to exit: the cold nightly. A second ``kiln nightly`` in the same clone
(the build cache now warm) is the reference measured beside it. Kiln's local
Prefect server is started first if it is not up, and before every nightly the
benchmark waits until the server has digested the previous run's events (its
CPU use under 10 % over 2 s, at most 120 s), so one nightly is not charged for
the last one's backlog; the wait is reported.

Usage::

    python benchmarks/bench_nightly.py [--repeats 5]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_build import kiln_command, server_pid, wait_quiet  # noqa: E402


def time_nightly(clone: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run([*kiln_command(), "nightly", "--out", "out"], cwd=clone, capture_output=True,
                          text=True, timeout=1800)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"kiln nightly failed in {clone}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pid, load_start, rows = server_pid(), os.getloadavg(), []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-nightly-") as tmp:
        for run in range(args.repeats):
            clone = Path(tmp) / f"clone-{run}"
            subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
            waited = wait_quiet(pid)
            cold = time_nightly(clone)
            waited_warm = wait_quiet(pid)
            warm = time_nightly(clone)
            rows.append({"cold_s": round(cold, 2), "warm_s": round(warm, 2),
                         "waited_s": [round(waited, 1), round(waited_warm, 1)]})
            print(json.dumps(rows[-1]), file=sys.stderr)
    cold_med = statistics.median(r["cold_s"] for r in rows)
    warm_med = statistics.median(r["warm_s"] for r in rows)
    print(json.dumps({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_start_end": [load_start, os.getloadavg()],
        "command": " ".join([*kiln_command(), "nightly", "--out", "out"]) + " (in a fresh clone)",
        "cold_s": cold_med, "warm_s": warm_med, "cold_vs_warm": round(cold_med / warm_med, 2), "runs": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
