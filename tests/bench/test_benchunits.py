"""Each kernel's manifest unit: failed on a crash, or on a regression when regressions fail."""

from __future__ import annotations

from kiln.tasks.bench.compare import KernelOutcome, compare_results, kernel_units
from tests.helpers.benchfakes import FakeTimer, fake_run


def _outcomes(results):
    by_kernel: dict[str, list] = {}
    for case in results.cases:
        by_kernel.setdefault(case.kernel, []).append(case)
    return [KernelOutcome(kernel=k, cases=tuple(v), duration_s=1.0) for k, v in by_kernel.items()]


def test_a_regression_fails_the_unit_when_regressions_fail():
    current = fake_run(FakeTimer(kernel=1.5e-3, seed=2), "cur")
    comparison = compare_results(fake_run(FakeTimer(seed=1), "base"), current, 0.05)
    units = kernel_units(_outcomes(current), comparison, fail_on_regression=True)
    assert [(u.id, u.state) for u in units] == [("bench/axpy", "failed"), ("bench/rownorm", "failed")]
    assert all(u.message.startswith("regression:") and u.stage == "bench" for u in units)


def test_a_regression_is_a_warning_when_regressions_do_not_fail():
    current = fake_run(FakeTimer(kernel=1.5e-3, seed=2), "cur")
    comparison = compare_results(fake_run(FakeTimer(seed=1), "base"), current, 0.05)
    units = kernel_units(_outcomes(current), comparison, fail_on_regression=False)
    assert all(u.state == "completed" and "regression (warning only)" in u.message for u in units)


def test_a_clean_comparison_completes_and_names_the_baseline():
    current = fake_run(FakeTimer(seed=2), "cur")
    comparison = compare_results(fake_run(FakeTimer(seed=1), "base-run"), current, 0.05)
    units = kernel_units(_outcomes(current), comparison, fail_on_regression=True)
    assert all(u.state == "completed" and "no regression vs run base-run" in u.message for u in units)


def test_a_crashed_kernel_fails_alone():
    current = fake_run(FakeTimer(seed=2), "cur")
    outcomes = _outcomes(current) + [KernelOutcome(kernel="broken", error="BenchmarkError: boom")]
    units = kernel_units(outcomes, compare_results(None, current, 0.05), fail_on_regression=True)
    assert [(u.id, u.state) for u in units] == [
        ("bench/axpy", "completed"), ("bench/rownorm", "completed"), ("bench/broken", "failed")]
    assert units[-1].message == "BenchmarkError: boom"
