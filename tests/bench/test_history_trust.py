"""History only Kiln wrote, in order: forged entries change no benchmark decision, and each is reported.

Five real nightlies (each with its run record, as the bench stage stores them) at one speed, then a run
50 % slower. Forged entries — dated in the far future so they sort last for ever, or a real run's entry
with its ``created`` changed — three times slower would make that run look faster. They are judged by the
bench stage's own ``compare_task``: the decision is the one without them, and the run's trend lines name
each forged entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.record import RunRecord, create_record
from kiln.core.store import Store
from kiln.flows.bench import compare_task
from kiln.flows.report.summary import BENCH_TREND_INFO
from kiln.tasks.bench.history import BaselineChoice, last_published, store_results
from kiln.tasks.bench.results import BenchResults, parse_results, parse_time
from kiln.tasks.bench.trust import HistoryReader
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.run.runs import artifact_store
from tests.helpers.benchfakes import FakeTimer, fake_run, keep, run_header

NOW = "2026-11-29T03:00:00Z"


@pytest.fixture
def config(benchproj: Path) -> KilnConfig:
    return load_config(benchproj)


def _nightly(i: int, kernel_s: float, created: str, run_id: str = "") -> BenchResults:
    return fake_run(FakeTimer(kernel=kernel_s, seed=i), run_id=run_id or f"night-{i}", created=created)


def _history(store: Store, config: KilnConfig) -> None:
    for day in range(5):
        keep(store, config, _nightly(day, 1e-3, f"2026-11-2{day}T03:00:00Z"))


def _plant(store: Store, key: str, results: BenchResults) -> None:
    """Write an entry as anything that can write the store could: no run record behind it."""
    store.put_immutable(key, results.to_json().encode(), "application/json", "no-cache")


def _judged(config: KilnConfig, store: Store, run_id: str) -> tuple[list[str], RunRecord]:
    """A run 50 % slower, judged by the bench stage's compare task against ``last`` and the window."""
    current = fake_run(FakeTimer(kernel=1.5e-3, seed=9), run_id=run_id, created=NOW)
    run = create_record(store, run_header(current), config.root / "views")
    comparison = compare_task.fn(config, BaselineChoice("last"), current, store, run, False, None)
    decisions = sorted(f"{w.key}: {w.judgement.decision} over {w.medians}" for w in comparison.windows)
    return decisions + [f"baseline {comparison.baseline_run}", f"regressions {len(comparison.regressions())}"], run


def test_forged_future_dated_entries_and_a_forged_created_change_no_regression_decision(config):
    store = artifact_store(config)
    _history(store, config)
    expected, _ = _judged(config, store, "honest")
    assert expected[-2:] == ["baseline night-4", "regressions 3"]

    planted = [f"bench-history/2999010{i}T000000Z-forged-{i}.json" for i in (1, 2, 3)]
    for i, key in zip((1, 2, 3), planted, strict=True):
        _plant(store, key, _nightly(10 + i, 3e-3, f"2999-01-0{i}T00:00:00Z", run_id=f"forged-{i}"))
    redated = _nightly(4, 3e-3, "2999-02-01T00:00:00Z")  # a real run's id, its `created` moved on
    _plant(store, "bench-history/29990201T000000Z-night-4.json", redated)
    backdated = _nightly(3, 3e-3, "2026-11-28T04:00:00Z")  # inside the window, but not when night-3 ran
    _plant(store, "bench-history/20261128T040000Z-night-3.json", backdated)

    decisions, run = _judged(config, store, "judged")
    assert decisions == expected
    where = store.url
    assert [line for line in run.info()[BENCH_TREND_INFO] if line.startswith("ignored")] == [
        f"ignored benchmark history {where}/bench-history/29990201T000000Z-night-4.json: dated 2999-02-01T00:00:00Z, "
        f"after the run reading it started ({NOW})",
        *(f"ignored benchmark history {where}/{key}: dated 2999-01-0{i}T00:00:00Z, after the run reading it "
          f"started ({NOW})" for i, key in zip((3, 2, 1), reversed(planted), strict=True)),
        f"ignored benchmark history {where}/bench-history/20261128T040000Z-night-3.json: they are dated "
        "2026-11-28T04:00:00Z, run night-3 started 2026-11-23T03:00:00Z",
    ]


def test_results_are_stored_only_as_the_run_that_produced_them(config):
    store = artifact_store(config)
    results = _nightly(0, 1e-3, "2026-11-20T03:00:00Z")
    header = run_header(results)
    create_record(store, header, config.root / "views")
    with pytest.raises(InvalidInputError, match="they are dated 2999-01-01T00:00:00Z, run night-0 started "
                                                "2026-11-20T03:00:00Z"):
        store_results(store, config, results.model_copy(update={"created": "2999-01-01T00:00:00Z"}), header)
    with pytest.raises(InvalidInputError, match="'nightly' run: only a release run's results become the release "
                                                "channel's release baseline"):
        store_results(store, config, results, header, channel="release")
    assert store.list("bench-history/") == []


def test_a_release_baseline_planted_from_a_nightly_is_ignored_and_reported(config):
    store = artifact_store(config)
    nightly = _nightly(0, 1e-3, "2026-11-20T03:00:00Z")
    create_record(store, run_header(nightly), config.root / "views")
    key = "bench-history/published/release/20261120T030000Z-night-0.json"
    _plant(store, key, nightly)
    release = fake_run(FakeTimer(seed=3), run_id="rel-1", flow="release", created="2026-11-19T03:00:00Z")
    keep(store, config, release, channel="release")
    reader = HistoryReader(store, parse_time(NOW))
    found = last_published(reader, config, "release", variant="cpu", metric="cpu")
    assert found is not None and found.run_id == "rel-1"
    assert reader.ignored == [f"ignored benchmark history {store.url}/{key}: a release baseline from run night-0, "
                              "a 'nightly' run, not a release"]


@pytest.mark.parametrize("created", ["2026-13-01T00:00:00Z", "tomorrow", "2026-11-29T03:00:00+01:00", ""])
def test_a_created_that_is_not_a_utc_time_is_refused_naming_the_field(created):
    document = fake_run(FakeTimer(seed=1)).model_dump(mode="json") | {"created": created}
    with pytest.raises(InvalidInputError, match=r"created: Value error, .* is not a UTC time of the form"):
        parse_results(json.dumps(document), "results.json")


def test_kiln_history_leaves_out_a_planted_entry_and_names_it(config):
    from kiln.flows.cli.history import show_history

    store = artifact_store(config)
    _history(store, config)
    key = "bench-history/29990101T000000Z-forged-1.json"
    _plant(store, key, _nightly(11, 3e-3, "2999-01-01T00:00:00Z", run_id="forged-1"))
    text = show_history(config, kernel="axpy", case="n1024", variant=None, metric=None, limit=30, plot=None)
    assert text.startswith("5 runs of variant cpu (cpu)")  # the five real nights, not the planted sixth
    assert text.splitlines()[-1].startswith(f"ignored benchmark history {store.url}/{key}: dated 2999-01-01T00:00:00Z, "
                                            "after the run reading it started (")
