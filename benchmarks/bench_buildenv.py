"""The CUDA-torch build environment of a variant: cold and warm, against a plain pip install.

- **kiln cold**: :func:`kiln.tasks.build.buildenv.ensure_env` with ``torch==2.14.1`` (the CUDA 13 build and its
  ``nvidia-*`` wheels, from this machine's local package source) into an empty environments directory.
- **kiln warm**: the same call again: the environment is found (what every later build of the variant pays).
- **baseline** (same run, alternating with the cold one): what a user does by hand, ``python -m venv`` and
  ``pip install torch==2.14.1`` into an empty directory, with the same pip configuration.

Usage::

    python benchmarks/bench_buildenv.py [--runs 2] [--requirement torch==2.14.1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kiln.tasks.build.buildenv import ensure_env

TIMEOUT_S = 3600


def _plain(root: Path, requirement: str) -> None:
    subprocess.run([sys.executable, "-I", "-m", "venv", str(root / "venv")], check=True, timeout=600)
    subprocess.run([str(root / "venv" / "bin" / "python"), "-I", "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", requirement], check=True, timeout=TIMEOUT_S)


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _one_run(requirement: str) -> tuple[float, float, float]:
    """Kiln cold, Kiln warm, plain pip: seconds, each into a fresh directory."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-buildenv-") as scratch:
        envs = Path(scratch) / "envs"
        cold = _timed(lambda: ensure_env(envs, [requirement], "cu130", TIMEOUT_S))
        warm = _timed(lambda: ensure_env(envs, [requirement], "cu130", TIMEOUT_S))
        shutil.rmtree(envs)
        plain = _timed(lambda: _plain(Path(scratch), requirement))
    return cold, warm, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--requirement", default="torch==2.14.1")
    args = parser.parse_args()
    runs = []
    for run in range(args.runs):
        runs.append(_one_run(args.requirement))
        cold, warm, plain = runs[-1]
        print(f"run {run + 1}: kiln cold {cold:.1f} s, warm {warm:.3f} s, plain pip {plain:.1f} s", flush=True)
    cold, warm, plain = (statistics.median(column) for column in zip(*runs, strict=True))
    print(f"median of {args.runs}: kiln cold {cold:.1f} s, warm {warm:.3f} s, plain pip {plain:.1f} s; "
          f"cold/plain {cold / plain:.2f}")


if __name__ == "__main__":
    main()
