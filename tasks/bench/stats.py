"""Noise-aware statistics for benchmark samples: pure functions, no timing here.

A case is flagged as a regression only when the slowdown exceeds the
threshold even at the edges of the noise: the *lower* bootstrap bound of the
current median must lie more than ``threshold`` above the *upper* bound of the
baseline's, and the median change must also exceed the relative spread (IQR)
of either run. The bootstrap assumes independent samples; real machines drift
within a run (load phases, clocks), so the spread guards what the interval
underestimates. A noisy night then neither cries wolf nor hides a real loss
behind a loose threshold (see tests/bench/test_benchstats.py for the table of
cases this was tuned on).

The bootstrap RNG is seeded: the same samples always give the same interval,
so a comparison can be re-derived from the stored results file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln.core.errors import InvalidInputError

DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Summary:
    """Median of per-call times (seconds), their spread (IQR) and the median's CI."""

    n: int
    median: float
    spread: float  # interquartile range, seconds
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class Verdict:
    """How the current median of one case compares to the baseline's."""

    change: float  # current / baseline - 1; +0.30 means 30% slower
    separated: bool  # the change is resolved by the noise (slower beyond threshold, or faster)
    regression: bool
    improvement: bool
    reason: str
    baseline: float = 0.0  # the two medians compared (seconds, or a kernel/reference ratio)
    current: float = 0.0
    noise: float = 0.0  # the larger relative spread (IQR / median) of the two runs


def _checked(samples: Sequence[float], what: str) -> np.ndarray:
    values = np.asarray(list(samples), dtype=float)
    if values.size == 0:
        raise InvalidInputError(f"{what}: no samples to summarise")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        bad = [float(v) for v in values if not math.isfinite(v) or v <= 0][:3]
        raise InvalidInputError(f"{what}: samples must be positive, finite times in seconds (got {bad})")
    return values


def bootstrap_median_ci(
    samples: Sequence[float],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median."""
    if not 0 < confidence < 1:
        raise InvalidInputError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise InvalidInputError(f"resamples must be at least 1, got {resamples}")
    values = _checked(samples, "bootstrap")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(resamples, values.size))
    medians = np.median(values[picks], axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(medians, [alpha, 1 - alpha])
    return float(low), float(high)


def summarize(samples: Sequence[float], *, what: str = "samples", seed: int = DEFAULT_SEED) -> Summary:
    """Median, IQR and the bootstrap CI of the median of per-call times."""
    values = _checked(samples, what)
    q25, median, q75 = np.quantile(values, [0.25, 0.5, 0.75])
    low, high = bootstrap_median_ci(values.tolist(), seed=seed)
    return Summary(n=int(values.size), median=float(median), spread=float(q75 - q25), ci_low=low, ci_high=high)


def judge(baseline: Summary, current: Summary, threshold: float) -> Verdict:
    """Regression = slower by more than ``threshold`` even at the edges of both runs' noise."""
    if not 0 < threshold < 10:
        raise InvalidInputError(f"threshold must be a fraction in (0, 10), got {threshold}")
    change = current.median / baseline.median - 1
    noise = _relative_spread(baseline, current)
    slower = current.ci_low / baseline.ci_high - 1 > threshold and change > noise
    faster = current.ci_high < baseline.ci_low
    regression = change > threshold and slower
    improvement = change < -threshold and faster
    if regression:
        reason = f"{change:+.1%} slower, beyond the {threshold:.0%} threshold and the noise"
    elif change > threshold:
        reason = f"{change:+.1%} but within the noise (intervals or spread overlap the threshold)"
    elif improvement:
        reason = f"{change:+.1%} faster"
    else:
        reason = f"{change:+.1%}, within the {threshold:.0%} threshold"
    return Verdict(change=change, separated=slower or faster, regression=regression,
                   improvement=improvement, reason=reason, baseline=baseline.median, current=current.median,
                   noise=noise)


def _relative_spread(*summaries: Summary) -> float:
    return max(s.spread / s.median for s in summaries)


def paired_ratios(kernel: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Kernel/reference time per interleaved block pair: load that hits both cancels out."""
    pairs = min(len(kernel), len(reference))
    return [k / r for k, r in zip(kernel[:pairs], reference[:pairs], strict=True)]
