"""Benchmark history as a time series: one row per stored run and case, oldest first (``kiln history``).

Reads what the bench stage already stores (:mod:`kiln.tasks.bench.history`): every nightly's results,
per variant and decision metric. A row says which commit, when, the case's median and spread (IQR)
and its change against the previous run of the same case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.core.errors import InvalidInputError
from kiln.tasks.bench.policy import Judgement, judge_window
from kiln.tasks.bench.results import BenchResults
from kiln.tasks.project.config import RegressionPolicy

DEFAULT_POLICY = RegressionPolicy()


@dataclass(frozen=True)
class Point:
    commit: str
    created: str
    run_id: str
    kernel: str
    case: str
    median_s: float
    spread_s: float
    change: float | None  # relative to the previous run of the same case on the same hardware: +0.10 is 10 % slower
    judgement: Judgement  # the regression policy over the comparable runs before it


def _wanted(results: BenchResults, kernel: str | None, case: str | None) -> list[tuple[str, str, float, float]]:
    return [(c.kernel, c.name, c.stats.median, c.stats.spread) for c in results.cases
            if c.metric == results.decision_metric and kernel in (None, c.kernel) and case in (None, c.name)]


def series(history: Sequence[BenchResults], *, kernel: str | None = None, case: str | None = None,
           policy: RegressionPolicy = DEFAULT_POLICY, threshold: float = 0.05) -> list[Point]:
    """Rows of ``history`` (oldest first) for ``kernel``/``case`` (all when None), each judged by ``policy``
    against the runs before it on the same hardware.

    Raises :class:`InvalidInputError` naming the kernel or case when the history holds none of it.
    """
    points: list[Point] = []
    before: dict[tuple[str, str, str, str], list[float]] = {}
    for results in history:
        machine = (results.hardware.device, results.hardware.cpu)
        for name, case_name, median, spread in sorted(_wanted(results, kernel, case)):
            earlier = before.setdefault((name, case_name, *machine), [])
            change = (median - earlier[-1]) / earlier[-1] if earlier else None
            points.append(Point(results.commit, results.created, results.run_id, name, case_name, median, spread,
                                change, judge_window(earlier, median, policy, threshold)))
            earlier.append(median)
    if history and not points:
        known = sorted({c.kernel for r in history for c in r.cases})
        what = " ".join(f"{label} {value!r}" for label, value in (("kernel", kernel), ("case", case)) if value)
        raise InvalidInputError(f"no stored benchmark of {what} in {len(history)} runs; kernels: {known}")
    return points


def only(history: Sequence[BenchResults], kernel: str | None, case: str | None) -> list[BenchResults]:
    """``history`` with each run's cases narrowed to ``kernel``/``case`` (for the plot)."""
    return [r.model_copy(update={"cases": tuple(c for c in r.cases if kernel in (None, c.kernel)
                                                and case in (None, c.name))}) for r in history]


def render(points: Sequence[Point]) -> str:
    """A fixed-width table: commit, date, kernel/case, median and spread in µs, change."""
    header = (f"{'commit':<12}  {'date':<10}  {'kernel/case':<40}  {'median µs':>10}  {'IQR µs':>8}  "
              f"{'change':>7}  policy")
    lines = [header, "-" * len(header)]
    for p in points:
        change = "" if p.change is None else f"{p.change:+.1%}"
        lines.append(f"{(p.commit or 'none')[:12]:<12}  {p.created[:10]:<10}  {f'{p.kernel}/{p.case}':<40}  "
                     f"{p.median_s * 1e6:>10.2f}  {p.spread_s * 1e6:>8.2f}  {change:>7}  {p.judgement.decision}")
    return "\n".join(lines) + "\n"
