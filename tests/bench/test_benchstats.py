"""Regression detection with a deterministic fake timer (no real timing anywhere here)."""

from __future__ import annotations

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.bench.compare import compare_results
from kiln.tasks.bench.stats import bootstrap_median_ci, judge, summarize
from tests.helpers.benchfakes import FakeTimer, fake_run

THRESHOLD = 0.05


def _compare(baseline: FakeTimer, current: FakeTimer):
    return compare_results(fake_run(baseline, "base"), fake_run(current, "cur"), THRESHOLD)


def test_a_30_percent_slowdown_is_flagged_on_every_case():
    current = FakeTimer(kernel=1.3e-3, seed=2)
    comparison = _compare(FakeTimer(seed=1), current)
    assert current.calls == [("kernel", "reference")] * 3  # kernel and reference measured together
    assert len(comparison.cases) == 3
    assert [c.regression for c in comparison.cases] == [True, True, True]
    assert all(0.25 < c.verdict.change < 0.35 for c in comparison.cases)


@pytest.mark.parametrize("seed", range(2, 12))
def test_a_rerun_with_the_same_distribution_is_not_flagged(seed):
    comparison = _compare(FakeTimer(seed=1), FakeTimer(seed=seed))
    assert comparison.cases and comparison.regressions() == []


@pytest.mark.parametrize("seed", range(2, 7))
def test_a_3_percent_change_inside_the_noise_is_not_flagged(seed):
    comparison = _compare(FakeTimer(sigma=0.05, seed=1), FakeTimer(kernel=1.03e-3, sigma=0.05, seed=seed))
    assert comparison.regressions() == []
    assert all(abs(c.absolute.change) < THRESHOLD + 0.03 for c in comparison.cases)


@pytest.mark.parametrize("seed", range(2, 7))
def test_a_huge_noise_run_gives_no_false_regression(seed):
    comparison = _compare(FakeTimer(seed=1), FakeTimer(sigma=0.8, seed=seed))
    assert comparison.regressions() == []


def test_a_huge_noise_run_hides_nothing_it_cannot_resolve_but_says_why():
    # 30% slower, but the noise is so large that the CIs overlap: not flagged, and the reason says so.
    comparison = _compare(FakeTimer(seed=1), FakeTimer(kernel=1.3e-3, sigma=0.8, seed=3))
    flagged_by_threshold = [c for c in comparison.cases if c.verdict.change > THRESHOLD and not c.regression]
    assert flagged_by_threshold, "the noisy run should show a slowdown above the threshold"
    assert all("within the noise" in c.verdict.reason for c in flagged_by_threshold)


def test_machine_drift_that_slows_the_reference_alike_is_not_a_regression():
    comparison = _compare(FakeTimer(seed=1), FakeTimer(kernel=1.3e-3, reference=2.6e-3, seed=2))
    assert comparison.regressions() == []
    assert all(c.absolute.regression for c in comparison.cases), "the kernel's own time did slow down"
    assert {c.basis for c in comparison.cases} == {"kernel/reference"}


def _with_torch(results, version: str):
    return results.model_copy(update={"versions": {**results.versions, "torch": version}})


def test_a_new_torch_that_speeds_up_the_reference_does_not_blame_the_kernel():
    baseline = _with_torch(fake_run(FakeTimer(seed=1), "base"), "2.12.0")
    current = _with_torch(fake_run(FakeTimer(reference=1.4e-3, seed=2), "cur"), "2.13.0")
    comparison = compare_results(baseline, current, THRESHOLD)
    assert comparison.regressions() == []
    assert {c.basis for c in comparison.cases} == {"kernel time"}
    assert any("reference changed" in note for note in comparison.notes)


def test_with_a_new_torch_a_slower_kernel_is_still_flagged_on_its_own_time():
    baseline = _with_torch(fake_run(FakeTimer(seed=1), "base"), "2.12.0")
    current = _with_torch(fake_run(FakeTimer(kernel=1.3e-3, reference=1.4e-3, seed=2), "cur"), "2.13.0")
    comparison = compare_results(baseline, current, THRESHOLD)
    assert [c.regression for c in comparison.cases] == [True, True, True]
    assert all("kernel time:" in c.describe() for c in comparison.cases)


def test_a_kernel_that_loses_ground_beyond_the_drift_is_still_flagged():
    comparison = _compare(FakeTimer(seed=1), FakeTimer(kernel=1.6e-3, reference=2.2e-3, seed=2))
    assert [c.regression for c in comparison.cases] == [True, True, True]


def test_a_30_percent_speedup_is_an_improvement_not_a_regression():
    comparison = _compare(FakeTimer(seed=1), FakeTimer(kernel=0.7e-3, seed=2))
    assert comparison.regressions() == []
    assert all(c.verdict.improvement for c in comparison.cases)


def test_cases_the_baseline_lacks_are_listed_not_judged():
    baseline = fake_run(FakeTimer(seed=1), "base")
    baseline = baseline.model_copy(update={"cases": baseline.cases[:1]})
    comparison = compare_results(baseline, fake_run(FakeTimer(kernel=2e-3, seed=2), "cur"), THRESHOLD)
    assert [c.key for c in comparison.cases] == [baseline.cases[0].key]
    assert len(comparison.unmatched) == 2


def test_no_baseline_means_no_comparison():
    comparison = compare_results(None, fake_run(FakeTimer(seed=1)), THRESHOLD)
    assert comparison.cases == () and comparison.regressions() == [] and comparison.baseline_run == ""


def test_the_bootstrap_is_reproducible_and_brackets_the_median():
    samples = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8, 1.0, 1.02, 0.98]
    first, second = bootstrap_median_ci(samples, seed=7), bootstrap_median_ci(samples, seed=7)
    assert first == second
    summary = summarize(samples)
    assert summary.ci_low <= summary.median <= summary.ci_high
    assert summary.ci_low < summary.ci_high
    assert summary.spread == pytest.approx(0.085)


@pytest.mark.parametrize("samples", [[], [1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf")]])
def test_samples_that_are_not_positive_finite_times_are_refused(samples):
    with pytest.raises(InvalidInputError, match="case-x"):
        summarize(samples, what="case-x")


@pytest.mark.parametrize("threshold", [0.0, -0.1, 10.0])
def test_a_threshold_outside_the_open_interval_is_refused(threshold):
    s = summarize([1.0, 1.1, 0.9])
    with pytest.raises(InvalidInputError, match="threshold"):
        judge(s, s, threshold)


def _flag_rate(true_change: float, sigma_base: float, sigma_cur: float, seeds: int = 60) -> float:
    import numpy as np

    flagged = 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        base = summarize(np.exp(rng.normal(0.0, sigma_base, 30)))
        cur = summarize((1 + true_change) * np.exp(rng.normal(0.0, sigma_cur, 30)))
        flagged += judge(base, cur, THRESHOLD).regression
    return flagged / seeds


@pytest.mark.parametrize(
    ("true_change", "sigma_base", "sigma_cur", "low", "high"),
    [
        (0.30, 0.03, 0.03, 1.0, 1.0),  # a real 30% loss: always caught
        (0.10, 0.03, 0.03, 0.9, 1.0),  # a real 10% loss on a quiet machine: caught
        (0.00, 0.03, 0.03, 0.0, 0.0),  # the same code again: never flagged
        (0.03, 0.05, 0.05, 0.0, 0.0),  # 3% inside 5% noise: never flagged
        (0.00, 0.03, 0.80, 0.0, 0.0),  # one huge-noise run: never a false regression
    ],
)
def test_flag_rates_over_many_seeded_runs(true_change, sigma_base, sigma_cur, low, high):
    assert low <= _flag_rate(true_change, sigma_base, sigma_cur) <= high
