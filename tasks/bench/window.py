"""Each case of a run judged by the regression policy over its window of stored runs (``[bench.regression]``).

The nightly and the release gate use this before any single baseline: a case's median against the
medians of the last ``window`` comparable runs (same variant and decision metric — what
:func:`kiln.tasks.bench.history.load_history` returns — and the same device and CPU), decided by
:func:`kiln.tasks.bench.policy.judge_window`. ``regressed`` is a regression (it blocks where the old
single-baseline comparison blocked); ``suspicious`` and ``insufficient data`` are reported and never
block. A case with ``insufficient data`` falls back to the single baseline (:mod:`kiln.tasks.bench.compare`),
so a first release, whose window is empty, is judged as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.tasks.bench.policy import Judgement, judge_window
from kiln.tasks.bench.results import BenchResults
from kiln.tasks.project.config import RegressionPolicy


@dataclass(frozen=True)
class WindowCase:
    key: tuple[str, str, str]  # kernel, case name, metric
    medians: tuple[float, ...]  # seconds: the comparable runs' medians, oldest first (the window)
    current: float
    judgement: Judgement
    decides: bool  # measured with the decision metric

    @property
    def judged(self) -> bool:
        """Enough comparable runs to decide: the window, not a single baseline, decides this case."""
        return self.judgement.decision != "insufficient data"

    @property
    def regression(self) -> bool:
        return self.decides and self.judgement.decision == "regressed"

    @property
    def suspicious(self) -> bool:
        return self.decides and self.judgement.decision == "suspicious"

    def _name(self) -> str:
        kernel, name, metric = self.key
        return f"{kernel}/{name} [{metric}]"

    def describe(self) -> str:
        return f"{self._name()} window: {self.judgement.describe()}"

    def gate_line(self, threshold: float) -> str:
        """The case, the window's median and this run's, the change and the band: one line of the gate."""
        j = self.judgement
        if j.baseline is None or j.change is None or j.band is None:
            return f"{self._name()} {j.decision} ({j.runs} comparable runs)"
        values = f"{j.baseline * 1e6:.2f} µs → {self.current * 1e6:.2f} µs"
        return (f"{self._name()} window median of {j.runs} runs {values} ({j.change:+.1%}; band ±{j.band:.1%}, "
                f"threshold {threshold:.0%})")

    def trend_line(self) -> str:
        """The compact line of the nightly summary: the window's medians, this run's, the decision."""
        medians = " ".join(f"{m * 1e6:.2f}" for m in self.medians) or "-"
        j = self.judgement
        detail = f" {j.change:+.1%}, band ±{j.band:.1%}" if j.change is not None and j.band is not None else ""
        return f"{self._name()}  {medians} → {self.current * 1e6:.2f} µs  {j.decision}{detail}"


def comparable(history: Sequence[BenchResults], current: BenchResults) -> list[BenchResults]:
    """Stored runs (oldest first) on the same device and CPU as ``current``, ``current`` itself left out."""
    machine = (current.hardware.device, current.hardware.cpu)
    return [r for r in history if r.run_id != current.run_id and (r.hardware.device, r.hardware.cpu) == machine]


def window_cases(history: Sequence[BenchResults], current: BenchResults, policy: RegressionPolicy,
                 threshold: float) -> tuple[WindowCase, ...]:
    """Every case of ``current`` judged against the last ``policy.window`` comparable runs of ``history``."""
    runs = comparable(history, current)
    found = []
    for case in current.cases:
        earlier = [r.case(case.key) for r in runs]
        medians = tuple(c.stats.median for c in earlier if c is not None)[-policy.window:]
        found.append(WindowCase(case.key, medians, case.stats.median,
                                judge_window(medians, case.stats.median, policy, threshold),
                                case.metric == current.decision_metric))
    return tuple(found)
