"""Dependency-closure check cost: Kiln's check of one variant's wheel vs the plain pip dry run it wraps.

- **check** (what every publish runs per variant unless the Prefect task cache answers):
  :func:`kiln.release.publish.closure.resolve` — stage the variant's index (pages, sidecars, links to the files),
  then ``pip install --isolated --dry-run --report`` of the wheel from it plus the dependency indexes.
- **baseline** (measured in the same run, alternating): the plain ``pip install --isolated --dry-run`` of the
  wheel's requirements alone from the same dependency indexes, without ``fast-deps``: where an index serves no
  PEP 658 metadata (this machine's PyPI) pip downloads every wheel of the closure to read its metadata.

The wheel carries the default project's requirements (torch, triton, numpy, kiln-runtime beside it); the
dependency index is PyPI, so both sides are network-bound.
Usage::

    python benchmarks/bench_closure.py [--runs 3] [--index https://pypi.org/simple]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers.wheelkit, for the fixture wheel

from kiln.core.wheels import read_wheel
from kiln.release.publish.closure import ClosureQuery, Staged, resolve
from tests.helpers.wheelkit import make_wheel

REQUIRES = ["torch>=2.6", "triton>=3.6; platform_system == 'Linux'", "numpy", "kiln-runtime"]
TIMEOUT_S = 900


def _baseline(index: str) -> None:
    subprocess.run([sys.executable, "-I", "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                    "--quiet", "--index-url", index, *[r for r in REQUIRES if r != "kiln-runtime"]],
                   check=True, capture_output=True, timeout=TIMEOUT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--index", default="https://pypi.org/simple")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-closure-"))
    wheel = make_wheel(tmp, "kiln-kernels", "0.1.0.dev1+cpu", requires=REQUIRES)
    runtime = make_wheel(tmp, "kiln-runtime", "0.1.0")
    query = ClosureQuery("cpu", Staged(read_wheel(wheel)[0], wheel), (Staged(read_wheel(runtime)[0], runtime),),
                         (args.index,))
    _baseline(args.index)  # warm pip's HTTP cache for both sides
    check, base = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        result = resolve(query)
        check.append(time.perf_counter() - start)
        assert result.ok, result.detail
        start = time.perf_counter()
        _baseline(args.index)
        base.append(time.perf_counter() - start)
    print(f"check    median {statistics.median(check):6.1f} s  runs {[round(t, 1) for t in check]}")
    print(f"baseline median {statistics.median(base):6.1f} s  runs {[round(t, 1) for t in base]}")
    print(f"ratio check/baseline {statistics.median(check) / statistics.median(base):.2f}")


if __name__ == "__main__":
    main()
