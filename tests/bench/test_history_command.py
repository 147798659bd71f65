"""``kiln history``: the stored nightlies' benchmark results by commit, oldest first, with the change per case."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.flows.cli import main
from kiln.flows.cli.history import show_history
from kiln.tasks.bench.series import series
from kiln.tasks.bench.trust import HistoryReader
from kiln.tasks.project.config import load_config
from kiln.tasks.run.runs import artifact_store
from tests.helpers.benchfakes import FakeTimer, fake_run, keep


def _stored(config, runs: list[tuple[str, str, float]]) -> None:
    """Store one nightly per (commit, created, kernel time) through the real harness's fake timer."""
    store = artifact_store(config)
    for i, (commit, created, kernel_s) in enumerate(runs):
        results = fake_run(FakeTimer(kernel=kernel_s, seed=i), run_id=f"n{i}", created=created)
        keep(store, config, results.model_copy(update={"commit": commit * 40}))


@pytest.fixture
def config(benchproj: Path):
    return load_config(benchproj)


def test_the_history_names_each_commit_and_the_policy_flags_the_jump_not_the_noise(config, tmp_path):
    """Four nights at one speed, then a kernel twice as slow: the table shows each commit oldest first, the
    jump of about +100 % judged "regressed" against the window; the same-speed nights are "ok" (noise only)
    once the window holds min_runs, "insufficient data" before."""
    times = [1e-3, 1e-3, 1e-3, 1e-3, 2e-3]
    _stored(config, [(commit, f"2026-11-2{i}T03:00:00Z", t) for i, (commit, t) in enumerate(zip("abcde", times,
                                                                                                  strict=True))])
    text = show_history(config, kernel="axpy", case="n1024", variant=None, metric=None, limit=30,
                        plot=tmp_path / "trend.png")
    rows = [line for line in text.splitlines() if "axpy/n1024" in line]
    assert [r.split()[0] for r in rows] == [c * 12 for c in "abcde"]  # by commit, oldest first
    assert [r.split()[-1] for r in rows[:3]] == ["data", "data", "data"]  # "insufficient data": under min_runs
    assert rows[3].split()[-1] == "ok" and rows[4].split()[-1] == "regressed", rows
    jump = float(rows[4].split()[-2].rstrip("%"))
    assert 80 < jump < 120, rows[4]  # twice the kernel time: about +100 % against the night before
    assert (tmp_path / "trend.png").stat().st_size > 0 and "5 runs of variant cpu (cpu)" in text


def test_the_policy_decides_by_the_window_and_its_noise():
    from kiln.tasks.bench.policy import judge_window
    from kiln.tasks.project.config import RegressionPolicy

    policy = RegressionPolicy(window=5, min_runs=3, noise_k=3.0)
    steady = [1.00, 1.01, 0.99, 1.00, 1.01]
    assert judge_window(steady, 1.02, policy, 0.05).decision == "ok"
    assert judge_window(steady, 1.30, policy, 0.05).decision == "regressed"
    assert judge_window(steady, 0.70, policy, 0.05).decision == "improved"
    noisy = [1.0, 1.2, 0.9, 1.1, 0.8]  # a 10 % slower run is inside this window's noise: not a regression
    assert judge_window(noisy, 1.1, policy, 0.05).decision == "suspicious"
    assert judge_window(steady[:2], 2.0, policy, 0.05).decision == "insufficient data"
    judged = judge_window(steady, 1.30, policy, 0.05)
    assert judged.runs == 5 and judged.baseline == 1.00 and "+30.0%" in judged.describe()


def test_series_keeps_every_case_and_compares_each_with_its_own_previous_run(config):
    _stored(config, [("a", "2026-11-27T03:00:00Z", 1e-3), ("b", "2026-11-28T03:00:00Z", 1e-3)])
    store = artifact_store(config)
    from kiln.tasks.bench.history import load_history

    points = series(load_history(HistoryReader(store, time.time()), config, variant="cpu", metric="cpu"))
    assert {(p.kernel, p.case) for p in points} == {("axpy", "n1024"), ("axpy", "n4096"), ("rownorm", "m8_n128")}
    assert all((p.change is None) == (p.commit == "a" * 40) for p in points)


def test_unknown_names_and_an_empty_history_are_clear_errors(config, capsys):
    with pytest.raises(InvalidInputError, match="no benchmark history under"):
        show_history(config, kernel=None, case=None, variant=None, metric=None, limit=30, plot=None)
    _stored(config, [("a", "2026-11-27T03:00:00Z", 1e-3)])
    with pytest.raises(InvalidInputError, match="no stored benchmark of kernel 'nope'.*kernels: \\['axpy', 'rownorm'\\]"):
        show_history(config, kernel="nope", case=None, variant=None, metric=None, limit=30, plot=None)
    with pytest.raises(InvalidInputError, match="variant 'rocm'"):
        show_history(config, kernel=None, case=None, variant="rocm", metric=None, limit=30, plot=None)
    assert main(["history", "--config", str(config.config_file), "--kernel", "nope"]) != 0
    assert "nope" in capsys.readouterr().err


def test_a_policy_that_cannot_decide_is_refused_at_load(benchproj):
    from kiln.core.errors import ConfigError

    text = benchproj.read_text() + "\n[bench.regression]\nwindow = 3\nmin_runs = 5\n"
    benchproj.write_text(text)
    with pytest.raises(ConfigError, match=r"min_runs \(5\) cannot exceed window \(3\)"):
        load_config(benchproj)
