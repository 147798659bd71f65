"""``kiln init`` time per public kernel package of the corpus (tests/fixtures/real_packages.toml).

Each pinned sdist is downloaded once (checked against its sha256), then ``kiln init`` runs ``--repeats`` times on
a fresh copy of it (``init_project``: inspect, render, check with Kiln's loader, write), each timed with
``time.perf_counter``; the median per package is printed as a Markdown table. Static inference only: nothing
builds. The process's first ``init_project`` pays for imports (the loader, pydantic): a warm-up run on the
first package is not counted.

Usage::

    python benchmarks/bench_init_corpus.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers.real_packages: the pins

from kiln.tasks.onboarding import init_project
from tests.helpers.real_packages import download_sdist, load_pin, pinned_names


def _once(sdist: Path, scratch: Path) -> float:
    copy = scratch / sdist.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(sdist, copy)
    start = time.perf_counter()
    init_project(copy)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-init-bench-") as tmp:
        root = Path(tmp)
        sdists = {name: download_sdist(load_pin(name), root / "dl" / name) for name in pinned_names()}
        _once(next(iter(sdists.values())), root / "warm")
        print("| package | files in sdist | median kiln init ms | min ms | max ms |\n|---|---|---|---|---|")
        for name, sdist in sdists.items():
            times = [_once(sdist, root / "run") * 1000 for _ in range(args.repeats)]
            files = sum(1 for p in sdist.rglob("*") if p.is_file())
            print(f"| {name} | {files} | {statistics.median(times):.0f} | {min(times):.0f} | {max(times):.0f} |")


if __name__ == "__main__":
    main()
