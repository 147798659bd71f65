"""Flaky tests and their quarantine: the policy (pure) and its list in a real local artifact store."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kiln.release.errors import InvalidInputError
from kiln.release.manifest import Unit
from kiln.release.store import LocalStore
from kiln.tasks.project.config_build import Quarantine
from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.flaky import QuarantineList, RunOutcomes, decide, from_json, to_json
from kiln.tasks.testing.quarantine import apply, judge_run, quarantine_key, read_quarantine

UNIT = "test/tiny/cpu"
NODE = "tests/test_tiny.py::test_sometimes"
STEADY = "tests/test_tiny.py::test_always"
COMMIT = "c0ffee" * 7
POLICY = Quarantine(window=10, min_runs=3, band_low=0.05, band_high=0.6, release_after=2)


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


def test_a_fail_rate_inside_the_band_across_commits_is_flaky_and_outside_it_is_not():
    commits = "abcdef"
    flips = ["pass", "fail", "pass", "pass", "fail"]
    history = [run(i, v, commits[i] * 40) for i, v in enumerate(flips)]
    decision = decide(QuarantineList(), history, run(5, "pass", "f" * 40), POLICY)
    assert [e.reason for e in decision.quarantined] == [
        "failed 2 of its last 6 runs (33%, inside the flaky band 5%–60%)"]
    mostly_failing = [run(i, "fail" if i != 2 else "pass", commits[i] * 40) for i in range(5)]
    assert decide(QuarantineList(), mostly_failing, run(5, "fail", "f" * 40), POLICY).quarantined == ()


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


def test_the_store_keeps_every_runs_outcomes_and_the_list_by_compare_and_swap(tmp_path: Path):
    store = LocalStore(tmp_path / "artifacts")
    for i, outcome in enumerate(["passed", "passed"]):
        judge_run(store, POLICY, "tiny.cpu", RunOutcomes.of(f"run-{i}", UNIT, COMMIT, 1_000.0 + i, _results(outcome)))
    assert read_quarantine(store, POLICY) == QuarantineList()
    decision = judge_run(store, POLICY, "tiny.cpu", RunOutcomes.of("run-2", UNIT, COMMIT, 1_002.0, _results("failed")))
    assert [e.nodeid for e in decision.excused] == [NODE]
    assert read_quarantine(store, POLICY) == decision.quarantine
    assert len(store.list(f"{POLICY.history}/outcomes/tiny.cpu/")) == 3
    # Two suites finishing at once each keep their change of the one document.
    other = "test/tiny/cpu2"
    for i in range(2):
        judge_run(store, POLICY, "tiny.cpu2", RunOutcomes.of(f"o-{i}", other, COMMIT, 2_000.0 + i, _results("passed")))
    workers = [threading.Thread(target=judge_run, args=(store, POLICY, name, RunOutcomes.of(
        f"{name}-last", unit, COMMIT, 3_000.0, _results("failed")))) for name, unit in (("tiny.cpu2", other),
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
        judge_run(store, policy, "tiny.cpu", RunOutcomes.of(f"run-{i}", UNIT, COMMIT, 1_000.0 + i, _results(outcome)))
    assert main(["quarantine", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == [f"  {UNIT}  {NODE}",
                                    f"    failed 1 of 3 on {COMMIT[:12]}; since run run-2 (1970-01-01 00:16)"]


@pytest.mark.parametrize(("table", "message"), [
    ({"windw": 3}, "unknown key 'testing.quarantine.windw'; did you mean 'window'?"),
    ({"band_low": 0.7, "band_high": 0.5}, "testing.quarantine: band_low (0.7) cannot exceed band_high (0.5)"),
    ({"min_runs": 12}, "testing.quarantine: min_runs (12) cannot exceed window (10)"),
    ({"release_after": 0}, "testing.quarantine.release_after: Input should be greater than or equal to 1"),
])
def test_a_bad_quarantine_table_is_refused_naming_the_key(table, message):
    import tomllib

    from kiln.release.errors import ConfigError
    from kiln.tasks.project.config import parse_config
    from tests.helpers.gitrepo import FIXTURES

    data = tomllib.loads((FIXTURES / "tiny" / "kiln.toml").read_text())
    with pytest.raises(ConfigError) as raised:
        parse_config({**data, "testing": {"quarantine": table}}, FIXTURES / "tiny")
    assert message in str(raised.value)
