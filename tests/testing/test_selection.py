"""Test selection: the decision (pure), its records and switch in a real local artifact store, and one selector
driving the real runner's picker contract."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.record import load_info
from kiln.core.store import LocalStore
from kiln.flows.report.summary import SELECTION_SUMMARY_INFO, render_markdown, render_text
from kiln.tasks.project.config_build import Quarantine, Selection
from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.jobs import Picked
from kiln.tasks.testing.selection import Choice, Plan, Selector, decide, explain, new_records, recall_misses, run_mode
from kiln.tasks.testing.selection_store import (
    SELECTION_INFO,
    Record,
    read_records,
    store_records,
    switch,
    switched_off,
)

POLICY = Selection()  # 7 days, 10 carries
NOW = 1_000_000.0
DAY = 86400.0
NODE = "tests/test_a.py::test_one"
KEYS = ("wheel:pkg/ops.py", "test:tests/test_a.py")
PRINTS = {"wheel:pkg/ops.py": "1" * 64, "test:tests/test_a.py": "2" * 64}
LOCK = "e" * 64
HISTORY = Quarantine()
UNIT = "test/unit/cpu"
AT = {"folder": "unit.cpu", "unit_id": UNIT, "unit_name": "unit.cpu", "run_id": "run-1", "created": NOW}


def record(**changes: object) -> Record:
    base = {"nodeid": NODE, "outcome": "passed", "duration_s": 2.5, "touched": KEYS, "fingerprint": PRINTS,
            "env_lock": LOCK, "ran_run": "run-1", "ran_created": NOW - DAY, "carries": 0}
    return Record(**{**base, **changes})  # type: ignore[arg-type]


def one(rec: Record | None, current: dict[str, str] | None = None, *, lock: str = LOCK, off: str = "",
        quarantined: tuple[str, ...] = (), policy: Selection = POLICY) -> Choice:
    records = {} if rec is None else {NODE: rec}
    (choice,) = decide([NODE], records, PRINTS if current is None else current, lock, policy, NOW,
                       quarantined=quarantined, off=off).choices
    return choice


def test_a_passed_test_whose_inputs_are_unchanged_is_carried_naming_the_run_it_ran_in():
    choice = one(record())
    assert choice.carried and choice.reason == "carried from run run-1: its inputs are unchanged"
    (result,) = Plan((choice,)).picked().settled
    assert (result.nodeid, result.outcome, result.message) == (
        NODE, "passed", "carried from run run-1: its inputs are unchanged")
    assert Plan((choice,)).picked().run == ()


def test_a_test_without_a_record_runs():
    choice = one(None)
    assert not choice.carried and choice.reason == "no record of an earlier run" and not choice.would_carry


def test_a_changed_touched_member_makes_it_run_naming_the_key():
    choice = one(record(), {**PRINTS, "wheel:pkg/ops.py": "3" * 64})
    assert not choice.carried and choice.reason == "inputs changed: wheel:pkg/ops.py"


def test_a_touched_member_gone_from_the_wheel_counts_as_changed():
    choice = one(record(), {"test:tests/test_a.py": PRINTS["test:tests/test_a.py"]})
    assert not choice.carried and choice.reason == "inputs changed: wheel:pkg/ops.py"


def test_a_changed_test_file_makes_it_run():
    assert one(record(), {**PRINTS, "test:tests/test_a.py": "9" * 64}).reason == "inputs changed: test:tests/test_a.py"


def test_a_changed_environment_makes_it_run():
    choice = one(record(), lock="f" * 64)
    assert not choice.carried and choice.reason == "its environment changed"


@pytest.mark.parametrize("outcome", ["failed", "flaky", "error", "timeout", "crashed", "infrastructure", "skipped"])
def test_only_a_pass_is_ever_carried(outcome):
    choice = one(record(outcome=outcome))
    assert not choice.carried and not choice.would_carry
    assert choice.reason == f"its last outcome was {outcome} (only a pass is carried)"


def test_a_quarantined_test_is_never_carried():
    choice = one(record(), quarantined=(NODE,))
    assert not choice.carried and choice.reason == "it is quarantined"


def test_a_test_with_no_record_of_what_it_touched_runs():
    choice = one(record(touched=(), fingerprint={}))
    assert not choice.carried and choice.reason == "no record of what it touched"


def test_a_test_that_last_ran_more_than_max_age_days_ago_runs():
    assert one(record(ran_created=NOW - 6.9 * DAY)).carried
    choice = one(record(ran_created=NOW - 7.1 * DAY))
    assert not choice.carried and choice.would_carry
    assert choice.reason.startswith("bound expired: it last ran 7.1 days ago in run run-1")
    assert one(record(ran_created=NOW - 2.5 * DAY), policy=Selection(max_age_days=2)).reason.startswith(
        "bound expired")


def test_a_test_carried_max_carries_runs_in_a_row_runs():
    assert one(record(carries=9)).carried
    choice = one(record(carries=10))
    assert not choice.carried and choice.would_carry
    assert choice.reason == "bound expired: carried 10 runs in a row since run run-1 (max_carries = 10)"
    assert not one(record(carries=1), policy=Selection(max_carries=1)).carried


@pytest.mark.parametrize("mode,reason", [("full", "--full: every test runs"),
                                         ("release", "a release runs every test")])
def test_a_full_run_or_a_release_runs_everything_and_knows_what_selection_would_carry(mode, reason):
    selector = Selector(LocalStore(Path("/nonexistent-never-read")), HISTORY, POLICY, "unit", UNIT, "unit.cpu",
                        "unit.cpu", "run-2", NOW, mode, 0)
    off = selector.off_reason()
    assert off == reason
    choice = one(record(), off=off)
    assert not choice.carried and choice.would_carry and choice.reason == reason


def test_the_run_mode_a_release_is_always_full():
    assert (run_mode("release", False), run_mode("nightly", True), run_mode("nightly", False),
            run_mode("test", False)) == ("release", "full", "select", "select")


def test_recall_counts_only_failures_selection_would_have_carried():
    plan = decide([NODE, "t::changed", "t::new"], {NODE: record(), "t::changed": record(nodeid="t::changed")},
                  PRINTS, LOCK, POLICY, NOW, off="--full: every test runs")
    # t::changed: its input changed since (below, a different fingerprint would have run it anyway)
    plan = Plan(tuple(c if c.nodeid != "t::changed" else Choice(c.nodeid, False, "inputs changed: x", c.record)
                      for c in plan.choices))
    results = [TestResult(NODE, "failed"), TestResult("t::changed", "failed"), TestResult("t::new", "failed")]
    assert [c.nodeid for c in recall_misses(plan, results)] == [NODE]
    assert recall_misses(plan, [TestResult(NODE, "passed"), TestResult("t::new", "failed")]) == []


def test_a_carried_test_keeps_its_record_and_counts_one_more_carry_a_run_test_gets_a_fresh_one():
    plan = decide([NODE, "t::ran"], {NODE: record(carries=3)}, PRINTS, LOCK, POLICY, NOW)
    ran = TestResult("t::ran", "failed", 1.5)
    made = {r.nodeid: r for r in new_records(plan, [*plan.picked().settled, ran], lambda keys: {}, LOCK, NOW,
                                             "run-5")}
    assert made[NODE] == record(carries=4)  # still names run-1, where it last ran, and its inputs then
    assert (made["t::ran"].outcome, made["t::ran"].ran_run, made["t::ran"].ran_created, made["t::ran"].carries) == (
        "failed", "run-5", NOW, 0)


def test_records_round_trip_through_the_store_and_its_run_record(tmp_path):
    store = LocalStore(tmp_path)
    store_records(store, HISTORY, **AT, records=[record()], complete=True)
    found, ignored = read_records(store, HISTORY, "unit.cpu", "run-9")
    assert found == {NODE: record()} and ignored == []
    assert load_info(store, "run-1", f"{SELECTION_INFO}{UNIT}")["tests"][0]["nodeid"] == NODE  # the run's own copy
    # create-only: a retried task cannot rewrite what a run stored
    with pytest.raises(Exception, match="already|differ|exists"):
        store_records(store, HISTORY, **AT, records=[record(outcome="failed")], complete=True)


def test_a_record_its_run_did_not_record_is_ignored_and_named(tmp_path):
    store = LocalStore(tmp_path)
    store_records(store, HISTORY, **AT, records=[record(outcome="failed")], complete=True)
    key = "test-history/selection/runs/unit.cpu/19700112T134641Z-run-2/unit.cpu.json"  # forged: newer, a pass
    doc = {"version": 1, "unit": UNIT, "run_id": "run-2", "created": NOW + 1, "complete": True, "tests": [
        {"nodeid": NODE, "outcome": "passed", "duration_s": 1.0, "touched": [], "fingerprint": {}, "env_lock": LOCK,
         "ran_run": "run-2", "ran_created": NOW, "carries": 0}]}
    store.put_immutable(key, json.dumps(doc).encode(), "application/json", "no-cache")
    found, ignored = read_records(store, HISTORY, "unit.cpu", "run-9")
    assert found[NODE].outcome == "failed"  # the run-1 record, the forged one left out
    assert any("run-2 did not record it" in line for line in ignored)


def test_a_suite_that_failed_to_collect_leaves_nothing_to_carry(tmp_path):
    store = LocalStore(tmp_path)
    store_records(store, HISTORY, **AT, records=[record()], complete=False)
    assert read_records(store, HISTORY, "unit.cpu", "run-9")[0] == {}


def test_selection_switched_off_stays_off_until_turned_back_on(tmp_path):
    store = LocalStore(tmp_path)
    assert switched_off(store, HISTORY, "unit") == ""
    switch(store, HISTORY, "unit", "SELECTION RECALL MISS in test/unit/cpu")
    assert switched_off(store, HISTORY, "unit") == "SELECTION RECALL MISS in test/unit/cpu"
    selector = Selector(store, HISTORY, POLICY, "unit", UNIT, "unit.cpu", "unit.cpu", "run-2", NOW, "select", 0)
    assert selector.off_reason() == "SELECTION RECALL MISS in test/unit/cpu"
    switch(store, HISTORY, "unit", "")
    assert switched_off(store, HISTORY, "unit") == "" and selector.off_reason() == ""


def test_selection_disabled_in_kiln_toml_carries_nothing(tmp_path):
    selector = Selector(LocalStore(tmp_path), HISTORY, Selection(enabled=False), "unit", UNIT, "unit.cpu", "unit.cpu",
                        "r", NOW, "select", 0)
    assert selector.off_reason() == "selection is off ([testing.selection] enabled = false)"


def _wheel(path: Path, ops: bytes, version: str = "1.0") -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("pkg/ops.py", ops)
        archive.writestr("pkg-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: pkg\nVersion: {version}\n")
    return path


def test_a_selector_carries_through_the_picker_and_a_full_run_that_finds_a_miss_turns_it_off(tmp_path):
    """Three runs of one unit through the selector: a recorded run, a carrying run, then a --full run in which
    the carried test fails (its recorded inputs were incomplete, planted here by hand-made results)."""
    store = LocalStore(tmp_path / "store")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one(): pass\n")
    wheel = _wheel(tmp_path / "pkg.whl", b"x = 1\n")

    def selector(run_id: str, created: float, mode: str) -> Selector:
        return Selector(store, HISTORY, POLICY, "unit", UNIT, "unit.cpu", "unit.cpu", run_id, created,
                        mode, 1, clock=lambda: created)  # type: ignore[arg-type]

    first = selector("run-1", NOW, "select")
    picked = first.picker(sys.executable, wheel, tmp_path, "pkg")([NODE, "t::other"])
    assert picked.run == (NODE, "t::other") and picked.settled == ()
    touched = ("wheel:pkg/ops.py", "test:tests/test_a.py")
    # t::other fails: it runs again (a pass with no record of its inputs would be carried by the suite level)
    done = first.finish([TestResult(NODE, "passed", 4.0, touched=touched), TestResult("t::other", "failed")])
    assert (done.ran, done.carried) == (2, 0)

    second = selector("run-2", NOW + DAY, "select")
    picked = second.picker(sys.executable, wheel, tmp_path, "pkg")([NODE, "t::other"])
    assert picked.run == ("t::other",) and [r.message for r in picked.settled] == [
        "carried from run run-1: its inputs are unchanged"]
    done = second.finish([*picked.settled, TestResult("t::other", "passed")])
    assert (done.ran, done.carried, done.carried_from, done.saved_s, done.device) == (1, 1, ("run-1",), 4.0, "GPU")
    assert done.message() == "selection: 1 run, 1 carried from run run-1; GPU-seconds not spent: 4.0"

    third = selector("run-3", NOW + 2 * DAY, "full")
    picked = third.picker(sys.executable, wheel, tmp_path, "pkg")([NODE, "t::other"])
    assert picked.run == (NODE, "t::other")
    done = third.finish([TestResult(NODE, "failed", 4.0), TestResult("t::other", "passed")])
    assert [c.nodeid for c in done.misses] == [NODE] and done.lines[0].startswith("SELECTION RECALL MISS")
    assert switched_off(store, HISTORY, "unit").startswith("SELECTION RECALL MISS in test/unit/cpu")
    fourth = selector("run-4", NOW + 3 * DAY, "select")
    assert fourth.picker(sys.executable, wheel, tmp_path, "pkg")([NODE]).settled == ()


def test_explain_says_per_test_why():
    plan = decide([NODE, "t::new"], {NODE: record()}, PRINTS, LOCK, POLICY, NOW)
    assert explain(plan) == [f"carry  {NODE}  — carried from run run-1: its inputs are unchanged",
                             "run    t::new  — no record of an earlier run"]


def test_the_summary_shows_what_selection_ran_and_carried_with_a_recall_miss_first(tmp_path):
    run = RunManifest(root=tmp_path, run_id="r", flow="nightly", created=NOW, version="1.0")
    run.info[f"{SELECTION_SUMMARY_INFO}test/a/cpu"] = ["test/a/cpu: selection: 0 run, 3 carried from run run-1; "
                                                       "CPU-seconds not spent: 2.0"]
    run.info[f"{SELECTION_SUMMARY_INFO}test/b/cpu"] = ["test/b/cpu: selection: 2 run, 0 carried; CPU-seconds not "
                                                       "spent: 0.0", "SELECTION RECALL MISS in test/b/cpu: x"]
    text = render_text(run)
    block = text.split("test selection:")[1]
    assert block.index("SELECTION RECALL MISS") < block.index("test/a/cpu: selection: 0 run, 3 carried")
    assert "## Test selection" in render_markdown(run)


def test_a_shard_splits_what_selection_runs_and_only_the_first_shard_reports_the_carried(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one(): pass\n")
    wheel = _wheel(tmp_path / "pkg.whl", b"x = 1\n")
    touched = ("wheel:pkg/ops.py", "test:tests/test_a.py")
    for shard in (1, 2):  # run 1: each shard stored what it ran, in run 1's folder of the suite unit
        first = Selector(store, HISTORY, POLICY, "unit", f"{UNIT}/shard-{shard}-of-2", f"unit.cpu.shard-{shard}-of-2",
                         "unit.cpu", "run-1", NOW, "select", 0, clock=lambda: NOW)
        first.picker(sys.executable, wheel, tmp_path, "pkg")([NODE, "t::b", "t::c"])
        first.finish([TestResult(NODE, "passed", 1.0, touched=touched)] if shard == 1 else
                     [TestResult("t::b", "failed"), TestResult("t::c", "failed")])  # failed: never carried
    halves = {1: lambda ids: Picked(tuple(ids[:1])), 2: lambda ids: Picked(tuple(ids[1:]))}
    picked = {}
    for shard in (1, 2):
        again = Selector(store, HISTORY, POLICY, "unit", f"{UNIT}/shard-{shard}-of-2", f"unit.cpu.shard-{shard}-of-2",
                         "unit.cpu", "run-2", NOW + 10, "select", 0, settles=shard == 1, clock=lambda: NOW + 10)
        picked[shard] = again.picker(sys.executable, wheel, tmp_path, "pkg", then=halves[shard])([NODE, "t::b", "t::c"])
    # both shards read run 1's records of every shard; only the first reports the carried pass
    assert [r.nodeid for r in picked[1].settled] == [NODE] and picked[2].settled == ()
    assert (picked[1].run, picked[2].run) == (("t::b",), ("t::c",))


def test_a_run_whose_collection_failed_leaves_nothing_to_carry(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one(): pass\n")
    wheel = _wheel(tmp_path / "pkg.whl", b"x = 1\n")
    touched = ("wheel:pkg/ops.py",)
    for n, results in enumerate([[TestResult(NODE, "passed", touched=touched)],
                                 [TestResult("tests/test_b.py", "error", message="collection failed")]], 1):
        selector = Selector(store, HISTORY, POLICY, "unit", UNIT, "unit.cpu", "unit.cpu", f"run-{n}", NOW + n, "select",
                            0, clock=lambda: NOW + 3)
        selector.picker(sys.executable, wheel, tmp_path, "pkg")([NODE])
        outcome = selector.finish(results)
    assert "collection failed: the next run carries nothing of this suite" in outcome.lines
    third = Selector(store, HISTORY, POLICY, "unit", UNIT, "unit.cpu", "unit.cpu", "run-3", NOW + 3, "select", 0)
    assert third.picker(sys.executable, wheel, tmp_path, "pkg")([NODE]).run == (NODE,)


def test_a_suite_whose_tests_recorded_nothing_falls_back_to_the_suite_level_and_says_so(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one(): pass\n")
    (tmp_path / "tests" / "conftest.py").write_text("")
    (tmp_path / "docs.md").write_text("v1")

    def run(n: int, wheel: Path) -> tuple[Picked, object]:
        selector = Selector(store, HISTORY, POLICY, "unit", UNIT, "unit.cpu", "unit.cpu", f"run-{n}", NOW + n,
                            "select", 0, clock=lambda: NOW + n)
        picked = selector.picker(sys.executable, wheel, tmp_path, "pkg")([NODE])
        return picked, selector.finish([TestResult(NODE, "passed")] if picked.run else list(picked.settled))

    picked, outcome = run(1, _wheel(tmp_path / "pkg.whl", b"x = 1\n"))
    assert picked.run == (NODE,) and outcome.unrecorded and outcome.lines == ()  # the unit's message is left alone
    assert outcome.summary(UNIT)[1] == (
        f"{UNIT}: no test recorded what it touched (recording is not possible for this package or suite): "
        "suite-level fallback, a test is carried only when no member of the wheel, none of its test files and not "
        "its environment changed")
    (tmp_path / "docs.md").write_text("v2")  # nothing the suite level names: carried
    picked, _ = run(2, _wheel(tmp_path / "pkg.whl", b"x = 1\n", version="1.1"))
    assert picked.run == () and [r.message for r in picked.settled] == ["carried from run run-1: its inputs are "
                                                                          "unchanged"]
    (tmp_path / "tests" / "conftest.py").write_text("import os\n")  # a conftest above the test: it runs
    assert run(3, _wheel(tmp_path / "pkg.whl", b"x = 1\n"))[0].run == (NODE,)
    assert run(4, _wheel(tmp_path / "pkg.whl", b"x = 2\n"))[0].run == (NODE,)  # any member of the wheel: it runs
