"""Flaky tests and their quarantine: the policy (pure) and its list in a real local artifact store."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.manifest import Unit
from kiln.core.record import Checkout, RunHeader, create_record
from kiln.core.store import LocalStore, Store
from kiln.tasks.project.config_build import Quarantine
from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.flaky import (
    Entry,
    Evidence,
    QuarantineList,
    RunOutcomes,
    UnitDecision,
    decide,
    from_json,
    to_json,
)
from kiln.tasks.testing.quarantine import (
    Judged,
    apply,
    judge_run,
    judge_suite,
    quarantine_key,
    read_quarantine,
)

UNIT = "test/tiny/cpu"
NODE = "tests/test_tiny.py::test_sometimes"
STEADY = "tests/test_tiny.py::test_always"
COMMIT = "c0ffee" * 7
POLICY = Quarantine(window=10, release_after=2, broken_after=3)


def run(i: int, sometimes: str, commit: str = COMMIT) -> RunOutcomes:
    return RunOutcomes(f"run-{i}", UNIT, commit, 1_000.0 + i, {NODE: sometimes, STEADY: "pass"})  # type: ignore[dict-item]


def test_a_test_that_failed_one_run_in_three_on_one_commit_is_quarantined_with_its_record():
    history = [run(0, "pass"), run(1, "pass")]
    decision = decide(QuarantineList(), history, run(2, "fail"), POLICY)
    (entry,) = decision.quarantined
    assert (entry.unit, entry.nodeid, entry.reason) == (UNIT, NODE, f"failed 1 of 3 on {COMMIT[:12]}")
    assert [(e.run_id, e.verdict) for e in entry.record] == [("run-0", "pass"), ("run-1", "pass"), ("run-2", "fail")]
    assert decision.excused == (entry,)  # its failure in this very run does not gate
    assert [e.nodeid for e in decision.quarantine.entries] == [NODE]  # the steady test stays out


def test_a_test_that_starts_failing_and_keeps_failing_is_broken_not_flaky():
    """On new commits, pass, pass, then fail, fail: no commit saw both and it never recovered."""
    history = [run(0, "pass", "a" * 40), run(1, "pass", "b" * 40), run(2, "fail", "c" * 40)]
    decision = decide(QuarantineList(), history, run(3, "fail", "d" * 40), POLICY)
    assert decision.quarantined == () and decision.excused == ()


def test_a_fail_rate_across_commits_without_a_pass_and_fail_on_one_commit_is_not_flaky():
    commits = "abcdef"
    flips = ["pass", "fail", "pass", "pass", "fail"]
    history = [run(i, v, commits[i] * 40) for i, v in enumerate(flips)]
    assert decide(QuarantineList(), history, run(5, "fail", "f" * 40), POLICY).quarantined == ()


def test_a_quarantined_test_failing_on_k_consecutive_commits_leaves_quarantine_and_gates():
    """Quarantined on COMMIT (pass, pass, fail); then it fails on every new commit. K = 3: on the third
    failing commit it is broken, not flaky — out of the list, its failure not excused, its suite failed."""
    runs = [run(0, "pass"), run(1, "pass")]
    decision = decide(QuarantineList(), runs, run(2, "fail"), POLICY)
    runs.append(run(2, "fail"))
    for i, commit in enumerate(["b" * 40, "c" * 40], start=3):
        decision = decide(decision.quarantine, runs, run(i, "fail", commit), POLICY)
        runs.append(run(i, "fail", commit))
        assert [e.nodeid for e in decision.excused] == [NODE]  # one or two failing commits: still a flake
    decision = decide(decision.quarantine, runs, run(5, "fail", "d" * 40), POLICY)
    assert decision.quarantine.entries == () and decision.excused == ()
    ((entry, why),) = decision.gating
    assert entry.nodeid == NODE and why.startswith("failed on 3 consecutive commits (bbbbbbbbbbbb, cccccccccccc, "
                                                   "dddddddddddd): a real break")
    results = [TestResult(NODE, "failed"), TestResult(STEADY, "passed")]
    unit = Unit(UNIT, "test", "failed", variant="cpu", suite="tiny", message="1 passed, 1 failed")
    judged = apply(unit, results, decision)
    assert judged.unit.state == "failed" and f"gates again: {NODE} left quarantine — failed on 3" in judged.lines[0]
    runs.append(run(5, "fail", "d" * 40))  # and it is not quarantined again while it stays broken
    assert decide(decision.quarantine, runs, run(6, "fail", "e" * 40), POLICY).quarantined == ()


def test_a_quarantine_expires_when_its_same_commit_evidence_leaves_the_window():
    policy = Quarantine(window=4, release_after=5, broken_after=3)
    runs = [run(0, "pass"), run(1, "fail")]
    decision = decide(QuarantineList(), runs[:1], runs[1], policy)
    assert decision.quarantined
    for i, (verdict, commit) in enumerate([("pass", "b"), ("fail", "c")], start=2):
        decision = decide(decision.quarantine, runs, run(i, verdict, commit * 40), policy)
        runs.append(run(i, verdict, commit * 40))
        assert decision.quarantine.entries  # COMMIT's pass and fail are still inside the last 4 runs
    decision = decide(decision.quarantine, runs, run(4, "fail", "d" * 40), policy)
    ((_, why),) = decision.gating
    assert "its quarantine expired" in why and decision.excused == ()


def test_quarantine_ends_after_release_after_consecutive_passes_and_old_evidence_is_not_held_again():
    first = decide(QuarantineList(), [run(0, "pass"), run(1, "pass")], run(2, "fail"), POLICY)
    runs = [run(0, "pass"), run(1, "pass"), run(2, "fail")]
    after_one = decide(first.quarantine, runs, run(3, "pass"), POLICY)
    assert after_one.released == () and len(after_one.quarantine.entries) == 1
    runs.append(run(3, "pass"))
    after_two = decide(after_one.quarantine, runs, run(4, "pass"), POLICY)
    ((freed, passes),) = after_two.released
    assert freed.nodeid == NODE and passes == 2 and after_two.quarantine.entries == ()
    runs.append(run(4, "pass"))
    # The commit's old failure is before the release: one more pass does not quarantine it again.
    again = decide(after_two.quarantine, runs, run(5, "pass"), POLICY)
    assert again.quarantined == () and again.quarantine.entries == ()


def test_a_failure_while_quarantined_restarts_the_count_and_is_excused():
    first = decide(QuarantineList(), [run(0, "pass"), run(1, "pass")], run(2, "fail"), POLICY)
    runs = [run(0, "pass"), run(1, "pass"), run(2, "fail"), run(3, "pass")]
    decision = decide(first.quarantine, runs, run(4, "fail"), POLICY)
    assert decision.released == () and [e.nodeid for e in decision.excused] == [NODE]
    runs.append(run(4, "fail"))
    assert decide(decision.quarantine, runs, run(5, "pass"), POLICY).released == ()  # one pass since the failure


def test_a_suite_failing_only_in_quarantined_tests_is_flaky_and_says_it_did_not_gate():
    decision = decide(QuarantineList(), [run(0, "pass"), run(1, "pass")], run(2, "fail"), POLICY)
    results = [TestResult(NODE, "failed", message="assert 1 == 2"), TestResult(STEADY, "passed")]
    unit = Unit(UNIT, "test", "failed", variant="cpu", suite="tiny", message="1 passed, 1 failed")
    judged = apply(unit, results, decision)
    assert judged.unit.state == "flaky"
    assert judged.lines == (f"quarantined: {NODE} (failed 1 of 3 on {COMMIT[:12]}) — did not gate publishing",)
    other = [*results, TestResult("tests/test_tiny.py::test_broken", "failed")]
    assert apply(unit, other, decision).unit.state == "failed"  # a failure outside quarantine still gates


def test_the_list_round_trips_through_json():
    decision = decide(QuarantineList(), [run(0, "pass"), run(1, "pass")], run(2, "fail"), POLICY)
    assert from_json(json.loads(json.dumps(to_json(decision.quarantine)))) == decision.quarantine


def _results(outcome: str) -> list[TestResult]:
    return [TestResult(NODE, outcome), TestResult(STEADY, "passed")]  # type: ignore[arg-type]


def _start(store: Store, run_id: str, created: float, commit: str = COMMIT) -> None:
    """The run's record as the flow starts it: its header, with the commit and the start time."""
    header = RunHeader(run_id, "nightly", "0.1.0", Checkout(commit, 0, (), True), created)
    create_record(store, header, Path(store.url.removeprefix("file://")).parent / "views")


def _judge(store: Store, policy: Quarantine, unit_name: str, run: RunOutcomes) -> UnitDecision:
    """``run`` as the test stage makes it: its run record started, then judged."""
    _start(store, run.run_id, run.created, run.commit)
    return judge_run(store, policy, unit_name, run)


def _suite(store: Store, run_id: str, created: float, outcome: str) -> Judged:
    """One run of the suite through the test stage's path: record started, tests ran, then judged."""
    _start(store, run_id, created)
    results = _results(outcome)
    failed = outcome == "failed"
    unit = Unit(UNIT, "test", "failed" if failed else "passed", variant="cpu", suite="tiny",
                message="1 passed, 1 failed" if failed else "2 passed")
    return judge_suite(store, POLICY, run_id=run_id, commit=COMMIT, created=created, unit_name="tiny.cpu", unit=unit,
                       results=results)


def test_a_forged_outcomes_file_changes_no_decision_and_is_reported(tmp_path: Path):
    """A pass planted in the history for the commit that now fails would make the failure a "flake"; the
    run it cites does not exist, or recorded something else: ignored, and the suite's lines say so."""
    store = LocalStore(tmp_path / "artifacts")
    assert _suite(store, "run-0", 1_000.0, "failed").unit.state == "failed"
    forged = [RunOutcomes("ghost", UNIT, COMMIT, 1_001.0, {NODE: "pass", STEADY: "pass"}),
              RunOutcomes("run-0", UNIT, COMMIT, 1_000.0, {NODE: "pass", STEADY: "pass"})]  # run-0 failed it
    keys = [f"{POLICY.history}/outcomes/tiny.cpu/19700101T0016{40 + i}Z-{run.run_id}.json" for i, run in enumerate(forged)]
    for key, run in zip(keys, forged, strict=True):  # planted beside the real file, as a writer of the store could
        doc = {"run_id": run.run_id, "unit": UNIT, "commit": COMMIT, "created": run.created, "outcomes": run.outcomes}
        store.put_immutable(key, json.dumps(doc).encode(), "application/json", "no-cache")
    judged = _suite(store, "run-1", 1_002.0, "failed")
    assert judged.unit.state == "failed" and read_quarantine(store, POLICY) == QuarantineList()
    assert judged.lines == (f"ignored test outcomes {keys[0]}: run ghost has no record in {store.url}",
                            f"ignored test outcomes {keys[1]}: its outcomes differ from those run run-0 recorded "
                            f"({NODE})")
    assert all(line in judged.unit.message for line in judged.lines)  # the summary's quarantine lines


def test_a_forged_quarantine_entry_changes_no_decision_and_is_reported(tmp_path: Path):
    """An entry that cites runs that never ran, or outcomes its runs did not record, excuses nothing:
    the failure gates, the summary names the entry, and the list is written again without it."""
    store = LocalStore(tmp_path / "artifacts")
    _suite(store, "run-0", 1_000.0, "failed")
    ghost = Entry(UNIT, NODE, "failed 1 of 2 on c0ffee", "ghost-2", 999.0,
                  (Evidence("ghost-1", COMMIT, "pass"), Evidence("ghost-2", COMMIT, "fail")))
    lying = Entry(UNIT, STEADY, "failed 1 of 2 on c0ffee", "run-0", 1_000.0,
                  (Evidence("run-0", COMMIT, "fail"), Evidence("run-0", COMMIT, "pass")))
    forged = (json.dumps(to_json(QuarantineList((ghost, lying)))) + "\n").encode()
    store.put_page(quarantine_key(POLICY), forged, "application/json", "no-cache", None)
    judged = _suite(store, "run-1", 1_001.0, "failed")
    assert judged.unit.state == "failed"
    assert judged.lines == (f"ignored quarantine entry {UNIT} {NODE}: run ghost-1 has no record in {store.url}",
                            f"ignored quarantine entry {UNIT} {STEADY}: it cites a fail in run run-0, which "
                            "recorded pass")
    assert read_quarantine(store, POLICY) == QuarantineList()


def test_the_store_keeps_every_runs_outcomes_and_the_list_by_compare_and_swap(tmp_path: Path):
    store = LocalStore(tmp_path / "artifacts")
    for i, outcome in enumerate(["passed", "passed"]):
        _judge(store, POLICY, "tiny.cpu", RunOutcomes.of(f"run-{i}", UNIT, COMMIT, 1_000.0 + i, _results(outcome)))
    assert read_quarantine(store, POLICY) == QuarantineList()
    decision = _judge(store, POLICY, "tiny.cpu", RunOutcomes.of("run-2", UNIT, COMMIT, 1_002.0, _results("failed")))
    assert [e.nodeid for e in decision.excused] == [NODE]
    assert read_quarantine(store, POLICY) == decision.quarantine
    assert len(store.list(f"{POLICY.history}/outcomes/tiny.cpu/")) == 3
    # Two suites finishing at once each keep their change of the one document.
    other = "test/tiny/cpu2"
    for i in range(2):
        _judge(store, POLICY, "tiny.cpu2", RunOutcomes.of(f"o-{i}", other, COMMIT, 2_000.0 + i, _results("passed")))
    workers = [threading.Thread(target=_judge, args=(store, POLICY, name, RunOutcomes.of(
        f"{name.replace('.', '-')}-last", unit, COMMIT, 3_000.0, _results("failed")))) for name, unit in (("tiny.cpu2", other),
                                                                                        ("tiny.cpu", UNIT))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert {e.unit for e in read_quarantine(store, POLICY).entries} == {UNIT, other}


def test_a_malformed_list_is_a_clear_error_naming_its_key(tmp_path: Path):
    store = LocalStore(tmp_path / "artifacts")
    store.put_page(quarantine_key(POLICY), b"{\"tests\": 3}", "application/json", "no-cache", None)
    with pytest.raises(InvalidInputError, match="test-history/quarantine.json is not a Kiln quarantine list"):
        read_quarantine(store, POLICY)


def test_kiln_quarantine_lists_the_stored_list(tmp_path: Path, capsys):
    import shutil

    from kiln.flows.cli import main
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.runs import artifact_store
    from tests.helpers.gitrepo import FIXTURES

    shutil.copytree(FIXTURES / "tiny", tmp_path / "tiny", ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    config_path = tmp_path / "tiny" / "kiln.toml"
    assert main(["quarantine", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.startswith("no test is quarantined (file://")
    store, policy = artifact_store(load_config(config_path)), load_config(config_path).testing.quarantine
    for i, outcome in enumerate(["passed", "passed", "failed"]):
        _judge(store, policy, "tiny.cpu", RunOutcomes.of(f"run-{i}", UNIT, COMMIT, 1_000.0 + i, _results(outcome)))
    assert main(["quarantine", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == [f"  {UNIT}  {NODE}",
                                    f"    failed 1 of 3 on {COMMIT[:12]}; since run run-2 (1970-01-01 00:16)"]
    forged = QuarantineList((*read_quarantine(store, policy).entries,
                             Entry(UNIT, STEADY, "made up", "ghost", 1.0, (Evidence("ghost", COMMIT, "fail"),))))
    store.put_page(quarantine_key(policy), json.dumps(to_json(forged)).encode(), "application/json", "no-cache",
                   store.get_page(quarantine_key(policy))[1])
    assert main(["quarantine", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == [f"  {UNIT}  {NODE}",
                                    f"    failed 1 of 3 on {COMMIT[:12]}; since run run-2 (1970-01-01 00:16)",
                                    f"ignored quarantine entry {UNIT} {STEADY}: run ghost has no record in {store.url}"]


@pytest.mark.parametrize(("table", "message"), [
    ({"windw": 3}, "unknown key 'testing.quarantine.windw'; did you mean 'window'?"),
    ({"band_low": 0.7, "band_high": 0.5}, "testing.quarantine: band_low (0.7) cannot exceed band_high (0.5)"),
    ({"min_runs": 12}, "testing.quarantine: min_runs (12) cannot exceed window (10)"),
    ({"release_after": 0}, "testing.quarantine.release_after: Input should be greater than or equal to 1"),
])
def test_a_bad_quarantine_table_is_refused_naming_the_key(table, message):
    import tomllib

    from kiln.core.errors import ConfigError
    from kiln.tasks.project.config import parse_config
    from tests.helpers.gitrepo import FIXTURES

    data = tomllib.loads((FIXTURES / "tiny" / "kiln.toml").read_text())
    with pytest.raises(ConfigError) as raised:
        parse_config({**data, "testing": {"quarantine": table}}, FIXTURES / "tiny")
    assert message in str(raised.value)
