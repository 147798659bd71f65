"""Tables and markdown for a benchmark run: what the Prefect artifacts show."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.tasks.bench.compare import Comparison, KernelOutcome
from kiln.tasks.bench.plots import plot_speedups, plot_trend, png_markdown, try_plot
from kiln.tasks.bench.results import BenchResults, CaseResult


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.2f}"


def _change(case: CaseResult, comparison: Comparison) -> tuple[str, str, str]:
    """Change of kernel time, change of kernel/reference, and the verdict."""
    found = comparison.for_case(case.key)
    if found is None:
        return ("", "", "no baseline" if not comparison.baseline_run else "new case")
    verdict = "REGRESSION" if found.regression else ("faster" if found.verdict.improvement else "ok")
    relative = "" if found.relative is None else f"{found.relative.change:+.1%}"
    return (f"{found.absolute.change:+.1%}", relative, verdict)


def kernel_rows(results: BenchResults, comparison: Comparison, kernel: str) -> list[dict[str, Any]]:
    """One row per case and metric of ``kernel``: times in µs, speed-up, rates, change vs baseline."""
    rows = []
    for case in (c for c in results.cases if c.kernel == kernel):
        change, relative, verdict = _change(case, comparison)
        rows.append({
            "case": case.name,
            "shape": " ".join(f"{k}={v}" for k, v in case.shape.items()),
            "dtype": case.dtype,
            "metric": case.metric,
            "kernel_us": _us(case.stats.median),
            "spread_us": _us(case.stats.spread),
            "reference_us": _us(case.reference.median if case.reference else None),
            "speedup": "" if case.speedup is None else f"{case.speedup:.2f}x",
            "GB/s": "" if case.gbps is None else f"{case.gbps:.1f}",
            "TFLOP/s": "" if case.tflops is None else f"{case.tflops:.3f}",
            "change_vs_baseline": change,
            "vs_reference_change": relative,
            "verdict": verdict,
        })
    return rows


def summary_markdown(results: BenchResults, comparison: Comparison, failed: dict[str, str]) -> str:
    """The run's headline: where it ran, what it was compared with, what regressed or failed."""
    hw = results.hardware
    lines = [
        f"# Benchmarks — {results.variant}, decided on `{results.decision_metric}`",
        "",
        f"- commit `{results.commit}`, size `{results.size}`, {len(results.cases)} case results",
        f"- hardware: {hw.device} (driver {hw.driver}), CPU {hw.cpu}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(results.versions.items())),
        f"- baseline: run `{comparison.baseline_run}` (threshold {comparison.threshold:.0%})"
        if comparison.baseline_run else "- baseline: none",
    ]
    lines += [f"- note: {note}" for note in comparison.notes if comparison.baseline_run]
    regressions = comparison.regressions()
    lines += ["", f"## Regressions: {len(regressions)}"] + [f"- {r.describe()}" for r in regressions]
    if failed:
        lines += ["", f"## Kernels that failed: {len(failed)}"] + [f"- `{k}`: {m}" for k, m in sorted(failed.items())]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Report:
    """Everything the run shows in the Prefect UI: one table per kernel, a summary, the plots."""

    tables: dict[str, tuple[str, list[dict[str, Any]]]]  # artifact key -> (description, rows)
    markdown: str
    plots: tuple[Path, ...]


def artifact_key(kernel: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "kiln-bench-" + (re.sub(r"[^a-z0-9]+", "-", kernel.lower()).strip("-") or "kernel")


def build_report(results: BenchResults, comparison: Comparison, outcomes: Sequence[KernelOutcome],
                 history: Sequence[BenchResults], bench_dir: Path, run_id: str) -> Report:
    """Draw the plots (failures are warnings) and render every table and the summary."""
    drawn = {
        "Speed-up per shape": try_plot("speed-up", plot_speedups, results, bench_dir / "speedup.png"),
        "Trend over stored history": try_plot("trend", plot_trend, history, bench_dir / "trend.png"),
    }
    plots = {title: path for title, path in drawn.items() if path is not None}
    tables = {
        artifact_key(o.kernel): (f"Benchmarks of {o.kernel} ({results.decision_metric}) — run {run_id}",
                                 kernel_rows(results, comparison, o.kernel))
        for o in outcomes
    }
    failed = {o.kernel: o.error for o in outcomes if o.error}
    markdown = summary_markdown(results, comparison, failed) + "".join(
        "\n" + png_markdown(path, title) for title, path in plots.items())
    return Report(tables=tables, markdown=markdown, plots=tuple(plots.values()))
