"""What the Prefect UI shows: a table per kernel, a summary naming regressions and failures."""

from __future__ import annotations

from pathlib import Path

from kiln.tasks.bench.compare import KernelOutcome, compare_results
from kiln.tasks.bench.report import artifact_key, build_report
from tests.helpers.benchfakes import FakeTimer, fake_run


def _outcomes(results, extra=()):
    kernels = dict.fromkeys(c.kernel for c in results.cases)
    return [KernelOutcome(k, tuple(c for c in results.cases if c.kernel == k)) for k in kernels] + list(extra)


def test_the_report_has_a_table_per_kernel_with_times_speedup_and_change(tmp_path: Path):
    baseline = fake_run(FakeTimer(seed=1), "base")
    current = fake_run(FakeTimer(kernel=1.5e-3, seed=2), "cur")
    report = build_report(current, compare_results(baseline, current, 0.05), _outcomes(current),
                          [baseline, current], tmp_path, "cur")
    assert set(report.tables) == {"kiln-bench-axpy", "kiln-bench-rownorm"}
    _, rows = report.tables["kiln-bench-axpy"]
    assert [r["case"] for r in rows] == ["n1024", "n4096"]
    assert all(r["verdict"] == "REGRESSION" and r["change_vs_baseline"].startswith("+") for r in rows)
    assert rows[0]["speedup"].endswith("x") and float(rows[0]["kernel_us"]) > 0
    assert [p.name for p in report.plots] == ["speedup.png", "trend.png"]
    assert "## Regressions: 3" in report.markdown and "data:image/png;base64," in report.markdown


def test_a_failed_kernel_is_named_in_the_summary(tmp_path: Path):
    current = fake_run(FakeTimer(seed=2), "cur")
    outcomes = _outcomes(current, [KernelOutcome("broken_op", error="BenchmarkError: kaput")])
    report = build_report(current, compare_results(None, current, 0.05), outcomes, [current], tmp_path, "cur")
    assert "kiln-bench-broken-op" in report.tables and report.tables["kiln-bench-broken-op"][1] == []
    assert "`broken_op`: BenchmarkError: kaput" in report.markdown
    assert [p.name for p in report.plots] == ["speedup.png"]  # one run: no trend yet, and no failure


def test_artifact_keys_use_only_what_prefect_allows():
    assert artifact_key("Gated_Delta.Decode") == "kiln-bench-gated-delta-decode"
