"""The publish stage's dependency check of the default project: its variants one at a time vs all at once.

Each variant's wheel carries the ``Requires-Dist`` the build writes for it from this repository's
``kiln.toml`` (:func:`kiln.tasks.wheel.assemble.requirements`, with the torch and Triton installed here as
the toolchain, so a GPU variant pins both), and the real ``kiln-runtime`` wheel is staged beside it; the
dependency index is PyPI (``[publish] extra_index_urls``), so every side is network-bound.

- **one at a time**: :func:`kiln.release.publish.closure.resolve` of each variant after the other.
- **at once** (what ``check_closure`` asks of its step): :func:`kiln.release.publish.closure.resolve_all` — every
  distinct question in its own pip at the same time, a question two variants share asked once.

Both use the check's own pip HTTP cache (warmed by one untimed round first, as the nightly before leaves it);
the publish flow also keeps each answer that resolved for 12 h (a Prefect task cache on the requirement set),
which this script does not exercise: a repeated question there costs nothing.

With ``--wheels <run>/wheels`` it checks a real nightly's wheels instead (their platform tags and exact
requirement sets, e.g. rocm without a torch pin).

Usage::

    python benchmarks/bench_publish_check.py [--runs 3] [--wheels out/<run-id>/wheels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.helpers.wheelkit, for the fixture wheels

from kiln.core.wheels import read_wheel  # noqa: E402
from kiln.release.publish.closure import ClosureQuery, Staged, resolve, resolve_all  # noqa: E402
from kiln.tasks.project.config import load_config  # noqa: E402
from kiln.tasks.wheel.assemble import requirements  # noqa: E402
from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel  # noqa: E402
from tests.helpers.wheelkit import make_wheel  # noqa: E402


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def built_queries(tmp: Path, wheels: Path) -> list[ClosureQuery]:
    """The questions of a real nightly's wheels (``<run>/wheels``), as its publish asks them."""
    config = load_config(REPO / "kiln.toml")
    runtime = build_runtime_wheel(tmp / "runtime")
    beside = (Staged(read_wheel(runtime)[0], runtime),)
    found = []
    for variant in config.variants:
        wheel = next(wheels.glob(f"*+{variant.name}-*.whl"))
        found.append(ClosureQuery(variant.name, Staged(read_wheel(wheel)[0], wheel), beside,
                                  tuple(config.publish.extra_index_urls)))
    return found


def queries(tmp: Path) -> list[ClosureQuery]:
    config = load_config(REPO / "kiln.toml")
    toolchain = {"torch": _installed("torch"), "triton": _installed("triton")}
    runtime = build_runtime_wheel(tmp / "runtime")
    beside = (Staged(read_wheel(runtime)[0], runtime),)
    found = []
    for variant in config.variants:
        requires = requirements(config, variant, toolchain, compiled=True, torch_extension=True)
        wheel = make_wheel(tmp / variant.name, config.project.distribution, f"0.1.0.dev1+{variant.name}",
                           requires=requires)
        found.append(ClosureQuery(variant.name, Staged(read_wheel(wheel)[0], wheel), beside,
                                  tuple(config.publish.extra_index_urls)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wheels", type=Path, help="a nightly's <run>/wheels: check its wheels instead of ones "
                                                   "made here with the requirements the build would write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-publish-check-") as tmp:
        asked = built_queries(Path(tmp), args.wheels) if args.wheels else queries(Path(tmp))
        for query in asked:
            print(f"{query.variant}: {query.requirement}")
        start = time.perf_counter()
        answers = resolve_all(asked)  # the untimed warm-up round
        print(f"warm-up round (at once) {time.perf_counter() - start:.1f} s")
        for query, answer in zip(asked, answers, strict=True):
            print(f"  {answer.describe(query)[:300]}")
        serial, parallel = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            for query in asked:
                resolve(query)
            serial.append(time.perf_counter() - start)
            start = time.perf_counter()
            resolve_all(asked)
            parallel.append(time.perf_counter() - start)
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"one at a time median {statistics.median(serial):6.1f} s  runs {[round(t, 1) for t in serial]}")
    print(f"at once       median {statistics.median(parallel):6.1f} s  runs {[round(t, 1) for t in parallel]}")
    print(f"ratio at once / one at a time {statistics.median(parallel) / statistics.median(serial):.2f}")


if __name__ == "__main__":
    main()
