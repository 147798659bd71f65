"""Test-environment cost: an isolated suite environment (warm base) vs the old shared-site one.

- **isolated** (what suites and benches get now): :func:`kiln.tasks.testing.envs.make_env` — a uv venv, the
  base environment layered in (found in ``$KILN_TEST_ENV_CACHE``, made first if missing: that cold time is
  reported once, apart), the wheel and its declared dependencies installed by uv, the import guard configured.
- **baseline** (measured in the same run, alternating): what ``make_env`` did before suites had environments
  of their own — a uv venv that sees Kiln's own site-packages (:func:`kiln.tasks.testing.envs.make_build_env`)
  and the wheel installed with ``--no-deps``.

The wheel requires torch and numpy (both in the base). Usage::

    python benchmarks/bench_test_envs.py [--runs 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers.wheelkit, for the fixture wheel

from kiln.core.venvs import uv_command
from kiln.tasks.testing import envs
from kiln.tasks.testing.baseenv import base_env, base_pins
from tests.helpers.wheelkit import make_wheel


def _baseline(root: Path, wheel: Path) -> None:
    python = envs.make_build_env(root)
    envs._run([*uv_command(), "pip", "install", "--quiet", "--offline", "--no-deps", "--python", str(python),
               str(wheel)], "baseline install")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-envs-"))
    wheel = make_wheel(work / "wheels", "needs-torch", "1.0", requires=["torch", "numpy"])
    start = time.perf_counter()
    base = base_env(base_pins())
    print(f"base environment {base.root}: ready in {time.perf_counter() - start:.1f} s (first call)")
    envs.make_env(work / "warm", [wheel])  # pip's configuration read once, uv's cache warm
    times: dict[str, list[float]] = {"isolated": [], "baseline": []}
    for run in range(args.runs):
        for name in ("isolated", "baseline") if run % 2 == 0 else ("baseline", "isolated"):
            root = work / f"{name}-{run}"
            start = time.perf_counter()
            envs.make_env(root, [wheel]) if name == "isolated" else _baseline(root, wheel)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} s of {[round(v, 2) for v in values]}")
    ratio = statistics.median(times["isolated"]) / statistics.median(times["baseline"])
    print(f"ratio isolated / baseline: {ratio:.2f}")


if __name__ == "__main__":
    main()
