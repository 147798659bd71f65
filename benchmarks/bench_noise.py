"""Run-to-run noise of the CPU benchmark harness: Kiln's timer vs a plain wall-clock timer.

    python benchmarks/bench_noise.py [--runs 6] [--config tests/bench/fixtures/benchproj/kiln.toml]

A regression gate is only as good as the agreement between two runs of the
same code. This script benchmarks the same project ``--runs`` times with each
of two timers, alternating them run by run so both see the same machine load:

* baseline — ``torch.utils.benchmark`` with its default wall clock, the kernel's
  blocks first and then the reference's (what a straightforward harness does);
* kiln — :class:`kiln.tasks.bench.harness.CpuTimer`: this thread's CPU clock, kernel and
  reference in alternating 10 ms blocks.

For every pair of consecutive runs of one timer it records, per case, the
change of the kernel's median time and of the kernel/reference ratio, and
whether :mod:`kiln.tasks.bench.compare` would flag a regression (always a false
alarm: the code did not change). Prints a JSON document and a markdown table
for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln.tasks.bench.compare import compare_results  # noqa: E402
from kiln.tasks.bench.harness import CpuTimer, assemble, bench_kernel, bench_specs, resolve_metric  # noqa: E402
from kiln.tasks.bench.results import iso_time  # noqa: E402
from kiln.tasks.project.config import load_config  # noqa: E402


@dataclass(frozen=True)
class SequentialWallTimer:
    """The baseline: wall clock, all kernel blocks, then all reference blocks."""

    min_run_time: float = 0.2

    def __call__(self, fn, reference, pool):
        from torch.utils import benchmark

        inputs = pool[0]
        samples = []
        for op in (fn, reference):
            op(*inputs)
            timer = benchmark.Timer(stmt="op(*inputs)", globals={"op": op, "inputs": inputs})
            samples.append(list(timer.blocked_autorange(min_run_time=self.min_run_time).times))
        return samples[0], samples[1]


def one_run(config, specs, timer, run_id: str):
    plan = resolve_metric("cpu", cuda_available=False)
    cases = [c for spec in specs for c in bench_kernel(spec, "small", plan, timers={"cpu": timer})]
    return assemble(config, plan, "small", cases, run_id=run_id, flow="bench", created=iso_time(time.time()))


def pair_stats(runs, threshold: float) -> dict:
    abs_changes, ratio_changes, flags, compared = [], [], 0, 0
    for before, after in itertools.pairwise(runs):
        comparison = compare_results(before, after, threshold)
        for case in comparison.cases:
            compared += 1
            abs_changes.append(abs(case.absolute.change))
            ratio_changes.append(abs(case.relative.change))
            flags += case.regression
    return {
        "median_abs_kernel_change": statistics.median(abs_changes),
        "max_abs_kernel_change": max(abs_changes),
        "median_abs_ratio_change": statistics.median(ratio_changes),
        "max_abs_ratio_change": max(ratio_changes),
        "false_regressions": flags,
        "comparisons": compared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--config", default=str(REPO / "tests/bench/fixtures/benchproj/kiln.toml"))
    args = parser.parse_args()
    config = load_config(args.config)
    specs = bench_specs(config)
    timers = {"baseline": SequentialWallTimer(), "kiln": CpuTimer()}
    runs: dict[str, list] = {name: [] for name in timers}
    seconds: dict[str, list[float]] = {name: [] for name in timers}
    for index in range(args.runs):
        for name, timer in timers.items():  # alternate, so both timers see the same load
            started = time.perf_counter()
            runs[name].append(one_run(config, specs, timer, f"{name}-{index}"))
            seconds[name].append(time.perf_counter() - started)
    report = {name: {**pair_stats(runs[name], config.bench.threshold),
                     "median_run_s": statistics.median(seconds[name])} for name in timers}
    report["machine"] = {"cpu": runs["kiln"][0].hardware.cpu, "python": platform.python_version(),
                         "torch": runs["kiln"][0].versions.get("torch")}
    report["ratio_kiln_vs_baseline_median_kernel_change"] = (
        report["kiln"]["median_abs_kernel_change"] / report["baseline"]["median_abs_kernel_change"])
    print(json.dumps(report, indent=2))
    print("\n| timer | median abs kernel change | max | median abs kernel/ref change | max | false regressions |"
          " median run (s) |\n|---|---|---|---|---|---|---|")
    for name in timers:
        r = report[name]
        print(f"| {name} | {r['median_abs_kernel_change']:.1%} | {r['max_abs_kernel_change']:.1%} | "
              f"{r['median_abs_ratio_change']:.1%} | {r['max_abs_ratio_change']:.1%} | "
              f"{r['false_regressions']} of {r['comparisons']} | {r['median_run_s']:.2f} |")


if __name__ == "__main__":
    main()
