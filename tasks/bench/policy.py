"""The regression policy over a window of stored runs (``[bench.regression]``).

One run against one baseline cannot tell a slow night from a slower kernel; a window can. The
baseline is the median of the case's medians over the last ``window`` comparable runs, the noise
is their scaled median absolute deviation (a robust standard deviation), and a change decides:

- ``regressed``: slower by more than the band, ``max(threshold, noise_k × noise)``;
- ``suspicious``: slower by more than the threshold but inside the noise band;
- ``improved``: faster by more than the band;
- ``ok``: anything else;
- ``insufficient data``: fewer than ``min_runs`` comparable runs before it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kiln.tasks.project.config import RegressionPolicy

Decision = Literal["regressed", "suspicious", "improved", "ok", "insufficient data"]
_MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation


@dataclass(frozen=True)
class Judgement:
    decision: Decision
    baseline: float | None  # seconds: the window's median
    change: float | None  # relative to the baseline
    band: float | None  # the relative change that counts as more than noise
    runs: int  # comparable runs in the window

    def describe(self) -> str:
        if self.baseline is None or self.change is None or self.band is None:
            return f"{self.decision} ({self.runs} comparable runs before it)"
        return (f"{self.decision}: {self.change:+.1%} against the median of {self.runs} runs "
                f"({self.baseline * 1e6:.2f} µs; band ±{self.band:.1%})")


def judge_window(previous: Sequence[float], current: float, policy: RegressionPolicy,
                 threshold: float) -> Judgement:
    """``current`` (a median, seconds) against ``previous`` medians of comparable runs, oldest first."""
    window = list(previous)[-policy.window:]
    if len(window) < policy.min_runs:
        return Judgement("insufficient data", None, None, None, len(window))
    baseline = statistics.median(window)
    mad = statistics.median(abs(x - baseline) for x in window)
    band = max(threshold, policy.noise_k * _MAD_TO_SIGMA * mad / baseline)
    change = current / baseline - 1
    if change > band:
        decision: Decision = "regressed"
    elif change > threshold:
        decision = "suspicious"
    elif change < -band:
        decision = "improved"
    else:
        decision = "ok"
    return Judgement(decision, baseline, change, band, len(window))
