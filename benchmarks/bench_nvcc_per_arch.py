"""What compiling each ``.cu`` once per arch costs a cold build, against one nvcc call with every arch.

The four sources of tests/fixtures/projects/multicu for sm_80 + sm_90 with no compile cache, the two ways in
turns: ``one_call_all_archs`` (one ``nvcc -c`` per translation unit with both ``-gencode``, plain, then the
link: what Kiln's nvcc units did before) and ``per_arch_combined`` (:func:`kiln.tasks.build.nvcc.build_library_counted`:
one nvcc call per arch, combined, in the staged directory and the guest sandbox, then the link and the
device-code check). Prints each median and the ratio.

Usage::

    python benchmarks/bench_nvcc_per_arch.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CSRC = REPO / "tests" / "fixtures" / "projects" / "multicu" / "multicu" / "csrc"
SOURCES = [CSRC / n for n in ("scale.cu", "shift.cu", "square.cu", "api.cpp")]
ARCHS = ("8.0", "9.0")


def one_call_all_archs(nvcc: str) -> None:
    from kiln.tasks.build.nvcc import gencode_flags

    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for number, source in enumerate(SOURCES):
            objects.append(f"{tmp}/{number}.o")
            subprocess.run([nvcc, "-c", "-Xcompiler", "-fPIC", "-O3", *gencode_flags(ARCHS), "-o", objects[-1],
                            str(source)], check=True, timeout=600)
        subprocess.run([nvcc, "-shared", "-Xlinker", "-s", "-o", f"{tmp}/lib.so", *objects, *gencode_flags(ARCHS)],
                       check=True, timeout=600)


def main() -> None:
    from kiln.tasks.build.nvcc import build_library_counted, find_nvcc

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    nvcc = find_nvcc()
    ways = {"one_call_all_archs": lambda: one_call_all_archs(nvcc.path),
            "per_arch_combined": lambda: build_library_counted(nvcc, SOURCES, "libmulticu.so", ARCHS, 600)}
    runs: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            runs[name].append(round(time.perf_counter() - start, 2))
    medians = {name: statistics.median(times) for name, times in runs.items()}
    print(json.dumps({"runs_s": runs, "medians_s": medians,
                      "ratio": round(medians["per_arch_combined"] / medians["one_call_all_archs"], 3)}, indent=2))


if __name__ == "__main__":
    main()
