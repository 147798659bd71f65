"""A cold test base: copied from Kiln's interpreter vs installed by pip (before), A/B.

What the first ``kiln nightly`` of a fresh clone pays before its first suite runs: in an empty
``$KILN_TEST_ENV_CACHE`` (a fresh folder per run, removed after), the cpu variant's base environment
(:func:`kiln.tasks.testing.baseenv.base_env`: torch, Triton, numpy, pytest, pydantic at Kiln's versions) and
then one suite environment on it (:func:`kiln.tasks.testing.envs.make_env`, a wheel requiring torch and numpy).

- **copied**: what Kiln does now where its interpreter has exactly those distributions (:mod:`.hostbase`).
- **pip**: the path before, and still the one where it does not (``host_distributions`` answering None):
  ``python -m venv`` and ``pip install`` from the machine's sources.

Both then byte-compile, make read-only and hash the base (:func:`~kiln.tasks.testing.baseenv.freeze`), timed
apart. The arms alternate (ABBA...), median of ``--runs`` each. Usage::

    python benchmarks/bench_test_base.py [--runs 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers.wheelkit, for the fixture wheel

from kiln.tasks.testing import baseenv, envs
from kiln.tasks.testing.hostbase import host_distributions
from tests.helpers.wheelkit import make_wheel


def _remove(root: Path) -> None:
    for here, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
    shutil.rmtree(root)


def _cold(work: Path, arm: str, wheel: Path, run: int) -> dict[str, float]:
    cache = work / f"cache-{arm}-{run}"
    os.environ[baseenv.CACHE_ENV] = str(cache)
    spent = {"freeze": 0.0}
    freeze = baseenv.freeze

    def timed_freeze(root: Path) -> None:
        start = time.perf_counter()
        freeze(root)
        spent["freeze"] = time.perf_counter() - start

    baseenv.freeze = timed_freeze
    baseenv.host_distributions = host_distributions if arm == "copied" else (lambda pins, site=None: None)
    try:
        start = time.perf_counter()
        base = baseenv.base_env(baseenv.base_pins())
        spent["base"] = time.perf_counter() - start
        envs.make_env(work / f"suite-{arm}-{run}", [wheel])
        spent["base + suite env"] = time.perf_counter() - start
    finally:
        baseenv.freeze, baseenv.host_distributions = freeze, host_distributions
    print(f"{arm} run {run}: base {spent['base']:.1f} s (freeze {spent['freeze']:.1f} s), "
          f"+ suite env {spent['base + suite env']:.1f} s [{base.root.name[:12]}]", flush=True)
    _remove(cache)
    shutil.rmtree(work / f"suite-{arm}-{run}")
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if host_distributions(baseenv.base_pins()) is None:
        raise SystemExit("this interpreter does not have the base's distributions: nothing to compare")
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-base-"))
    wheel = make_wheel(work / "wheels", "needs-torch", "1.0", requires=["torch", "numpy"])
    times: dict[str, list[dict[str, float]]] = {"copied": [], "pip": []}
    for run in range(args.runs):
        for arm in ("copied", "pip") if run % 2 == 0 else ("pip", "copied"):
            times[arm].append(_cold(work, arm, wheel, run))
    for part in ("base", "freeze", "base + suite env"):
        medians = {arm: statistics.median(t[part] for t in runs) for arm, runs in times.items()}
        print(f"{part}: " + ", ".join(f"{arm} median {m:.1f} s of {[round(t[part], 1) for t in times[arm]]}"
                                      for arm, m in medians.items())
              + f"; ratio copied / pip {medians['copied'] / medians['pip']:.2f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
