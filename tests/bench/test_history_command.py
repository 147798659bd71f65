"""``kiln history``: the stored nightlies' benchmark results by commit, oldest first, with the change per case."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.flows.history import show_history
from kiln.release.errors import InvalidInputError
from kiln.tasks.bench.history import history_store, store_results
from kiln.tasks.bench.series import series
from kiln.tasks.project.config import load_config
from tests.bench.fakes import FakeTimer, fake_run


def _stored(config, runs: list[tuple[str, str, float]]) -> None:
    """Store one nightly per (commit, created, kernel time) through the real harness's fake timer."""
    store = history_store(config)
    for i, (commit, created, kernel_s) in enumerate(runs):
        results = fake_run(FakeTimer(kernel=kernel_s, seed=i), run_id=f"n{i}", created=created)
        store_results(store, config, results.model_copy(update={"commit": commit * 40}))


@pytest.fixture
def config(benchproj: Path):
    return load_config(benchproj)


def test_the_history_names_each_commit_and_the_jump_of_a_slower_one(config, tmp_path):
    _stored(config, [("a", "2026-11-27T03:00:00Z", 1e-3), ("b", "2026-11-28T03:00:00Z", 1e-3),
                     ("c", "2026-11-29T03:00:00Z", 2e-3)])
    text = show_history(config, kernel="axpy", case="n1024", variant=None, metric=None, limit=30,
                        plot=tmp_path / "trend.png")
    rows = [line for line in text.splitlines() if "axpy/n1024" in line]
    assert [r.split()[0] for r in rows] == ["a" * 12, "b" * 12, "c" * 12]  # by commit, oldest first
    assert not rows[0].endswith("%")  # the first run has nothing to compare with
    jump = float(rows[2].split()[-1].rstrip("%"))
    assert 80 < jump < 120, rows[2]  # twice the kernel time: about +100 %
    assert abs(float(rows[1].split()[-1].rstrip("%"))) < 10, rows[1]  # same time: noise only
    assert (tmp_path / "trend.png").stat().st_size > 0 and "3 runs of variant cpu (cpu)" in text


def test_series_keeps_every_case_and_compares_each_with_its_own_previous_run(config):
    _stored(config, [("a", "2026-11-27T03:00:00Z", 1e-3), ("b", "2026-11-28T03:00:00Z", 1e-3)])
    store = history_store(config)
    from kiln.tasks.bench.history import load_history

    points = series(load_history(store, config, variant="cpu", metric="cpu"))
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
