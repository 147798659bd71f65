"""The nightly and the release gate judge each case by the regression policy over its window of stored runs.

Histories are measured through the real harness with a seeded fake timer (tests/helpers/benchfakes.py): five
nights at one speed on one machine, then the run under judgement.
"""

from __future__ import annotations

from kiln.tasks import releasing
from kiln.tasks.bench.compare import KernelOutcome, compare_results, comparison_record, kernel_unit
from kiln.tasks.bench.results import Hardware
from kiln.tasks.bench.window import window_cases
from kiln.tasks.project.config import RegressionPolicy
from tests.helpers.benchfakes import FakeTimer, fake_run

POLICY = RegressionPolicy(window=5, min_runs=3, noise_k=3.0)
THRESHOLD = 0.05
PASSED = {"build": ("COMPLETED", ""), "test": ("COMPLETED", "")}


def _nights(times: list[float]) -> list:
    return [fake_run(FakeTimer(kernel=t, seed=i), run_id=f"night-{i}") for i, t in enumerate(times)]


def _judge(history, current, blocking=("cpu",), fail_on_regression=True):
    """What the bench stage decides and records, and the release gate's verdict on it."""
    comparison = compare_results(history[-1], current, THRESHOLD,
                                 windows=window_cases(history, current, POLICY, THRESHOLD))
    units = [kernel_unit(KernelOutcome(k, tuple(c for c in current.cases if c.kernel == k)), comparison,
                         fail_on_regression, blocking) for k in ("axpy", "rownorm")]
    bench = ("FAILED" if any(u.state == "failed" for u in units) else "COMPLETED", "")
    record = comparison_record(comparison, fail_on_regression, blocking)
    return comparison, units, releasing.gate_decision({**PASSED, "bench": bench}, record, None)


def test_a_planted_slowdown_beyond_the_band_is_regressed_and_blocks_the_release():
    history = _nights([1e-3] * 5)
    comparison, units, gate = _judge(history, fake_run(FakeTimer(kernel=1.5e-3, seed=9), run_id="now"))
    assert {w.judgement.decision for w in comparison.windows} == {"regressed"}
    assert all(w.judgement.runs == 5 for w in comparison.windows)
    assert [u.state for u in units] == ["failed", "failed"] and "window: regressed: +" in units[0].message
    assert not gate.passed
    assert gate.lines[1] == ("benchmarks judged by the regression policy over the last 5 comparable runs on this "
                             "hardware (3 cases)")
    assert "blocking regressions (3):" in gate.lines
    assert any("window median of 5 runs" in line and "band ±" in line for line in gate.lines)


def test_a_noise_only_change_within_the_measured_spread_is_not_flagged():
    history = _nights([1e-3] * 5)
    comparison, units, gate = _judge(history, fake_run(FakeTimer(kernel=1e-3, seed=42), run_id="now"))
    assert {w.judgement.decision for w in comparison.windows} == {"ok"}
    assert comparison.regressions() == [] and [u.state for u in units] == ["completed", "completed"]
    assert "judged over the last 5 runs on this hardware: ok" in units[0].message
    assert gate.passed and gate.lines[-1] == "build, tests and benchmarks passed the gate"


def test_a_change_inside_a_noisy_windows_band_is_suspicious_reported_and_not_blocking():
    history = _nights([1.0e-3, 1.2e-3, 0.9e-3, 1.1e-3, 0.8e-3])
    comparison, units, gate = _judge(history, fake_run(FakeTimer(kernel=1.12e-3, seed=7), run_id="now"))
    assert {w.judgement.decision for w in comparison.windows} == {"suspicious"}
    assert [u.state for u in units] == ["completed", "completed"] and "suspicious (not blocking)" in units[0].message
    assert gate.passed
    assert any(line.startswith("suspicious (3; slower than the threshold but inside the window's noise band")
               for line in gate.lines)


def test_too_few_runs_on_this_hardware_fall_back_to_the_single_baseline():
    """Two runs are under min_runs, and runs on another machine are not comparable: the last run decides."""
    elsewhere = [r.model_copy(update={"hardware": Hardware(device="cpu", driver="none", cpu="other")})
                 for r in _nights([1e-3] * 3)]
    history = elsewhere + _nights([1e-3] * 2)
    comparison, units, gate = _judge(history, fake_run(FakeTimer(kernel=1.5e-3, seed=9), run_id="now"))
    assert {w.judgement.decision for w in comparison.windows} == {"insufficient data"}
    assert all(w.judgement.runs == 2 for w in comparison.windows)
    assert comparison.baseline_run == "night-1" and len(comparison.regressions()) == 3
    assert all(r.describe().startswith(("axpy/", "rownorm/")) and "window" not in r.describe()
               for r in comparison.regressions())
    assert not gate.passed and gate.lines[1].startswith("benchmarks compared with the last published release")


def test_the_trend_line_shows_the_windows_medians_and_the_decision():
    history = _nights([1e-3] * 5)
    (first, *_) = window_cases(history, fake_run(FakeTimer(kernel=1.5e-3, seed=9), run_id="now"), POLICY, THRESHOLD)
    line = first.trend_line()
    head, _, rest = line.partition(" → ")
    assert head.startswith("axpy/n1024 [cpu]  ") and len(head.split()) == 2 + 5  # name, metric, five medians
    assert " µs  regressed +" in rest and "band ±" in rest


def test_the_nightly_summary_shows_each_cases_trend(tmp_path):
    from kiln.core.manifest import RunManifest
    from kiln.flows.report.summary import BENCH_TREND_INFO, render_markdown, render_text

    lines = [w.trend_line() for w in window_cases(_nights([1e-3] * 5), fake_run(FakeTimer(seed=9), run_id="now"),
                                                  POLICY, THRESHOLD)]
    run = RunManifest(tmp_path, "r1", flow="nightly", version="1.0.dev1", info={BENCH_TREND_INFO: lines})
    markdown = render_markdown(run)
    assert "## Benchmark trend" in markdown and all(line in markdown for line in lines)
    assert all(f"    {line}" in render_text(run) for line in lines)
