"""The sandbox's cost per guest process: ``python -c pass`` started plainly vs through ``kiln.core.sandbox``.

    python benchmarks/bench_sandbox.py [--runs 30]

Each run starts both commands in turn (so load drifts hit both alike) and prints the median, minimum and
maximum wall time of each and the ratio of the medians. A test worker, a compile worker, a build backend and a
benchmark process each pay it once; the tests a worker forks do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.core.sandbox import Policy, guest_env, kiln_trees, wrap


def _time(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=120)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-sandbox-") as tmp:
        work = Path(tmp)
        plain = [sys.executable, "-c", "pass"]
        guarded = wrap(plain, Policy(read=tuple(sorted(kiln_trees())), write=(str(work),), network="loopback"))
        env = guest_env(dict(os.environ), work / "home")
        times: dict[str, list[float]] = {"plain": [], "sandboxed": []}
        for _ in range(ns.runs):
            times["plain"].append(_time(plain, env))
            times["sandboxed"].append(_time(guarded, env))
    for name, values in times.items():
        print(f"{name:<10} median {statistics.median(values) * 1000:7.1f} ms  min {min(values) * 1000:7.1f} ms  "
              f"max {max(values) * 1000:7.1f} ms  ({len(values)} runs)")
    ratio = statistics.median(times["sandboxed"]) / statistics.median(times["plain"])
    extra = (statistics.median(times["sandboxed"]) - statistics.median(times["plain"])) * 1000
    print(f"sandboxed / plain: {ratio:.2f}x (+{extra:.1f} ms a guest process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
