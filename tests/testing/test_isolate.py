"""The isolation runner on the fixture suites: classification, deadlines, no leftovers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.process import DUMP_WINDOW_S
from kiln.tasks.testing.runner import RunOptions, run_tests
from tests.helpers.procs_tree import running

REPO = Path(__file__).resolve().parents[2]
LADDER = "tests/fixtures/suites/ladder"
# The repo's own tests/conftest.py (Prefect set-up) is no part of the fixture suites.
FIXTURE_ARGS = ("--confcutdir", "tests/fixtures")
TIMEOUT_S, GRACE_S = 2.0, 1.0
EXPECTED = {
    "test_passes": "passed",
    "test_assertion_fails": "failed",
    "test_raises_error": "error",
    "test_skips": "skipped",
    "test_sleeps_forever": "timeout",
    "test_segfaults": "crashed",
    "test_grandchild_ignores_sigterm": "timeout",
    "test_passes_but_leaves_grandchild": "passed",
    "test_infrastructure_then_passes": "flaky",
}


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paths: list[str], **options) -> dict:
    # The tests run sandboxed: they write only under the work directory, and see the variable by name.
    state = tmp_path / "work" / "state"
    state.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("KILN_FIXTURE_DIR", str(state))
    options.setdefault("pass_env", ("KILN_FIXTURE_DIR",))
    options.setdefault("pytest_args", FIXTURE_ARGS)
    options.setdefault("preload", ())
    results = run_tests(paths, REPO, tmp_path / "work", RunOptions(**options))
    return {r.nodeid.rsplit("::", 1)[-1]: r for r in results}


def _assert_no_survivors(state: Path) -> None:
    pidfiles = sorted(state.glob("*.pid"))
    assert pidfiles, "the fixture wrote no pid files: the check below would prove nothing"
    for pidfile in pidfiles:
        assert not running(int(pidfile.read_text())), pidfile.name


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ladder")
    with pytest.MonkeyPatch.context() as mp:
        start = time.monotonic()
        # The real preload, as the test stage uses it.
        results = _run(tmp, mp, [LADDER], timeout_s=TIMEOUT_S, grace_s=GRACE_S, retries=1,
                       preload=RunOptions().preload)
        return results, tmp / "work" / "state", time.monotonic() - start


def test_every_fixture_test_gets_its_class(ladder):
    results, _, _ = ladder
    assert {name: r.outcome for name, r in results.items()} == EXPECTED


def test_assertion_failure_names_the_assertion(ladder):
    assert "assert [1, 2] == [1, 3]" in ladder[0]["test_assertion_fails"].message


def test_crash_names_its_signal_and_keeps_the_fatal_stack(ladder):
    crashed = ladder[0]["test_segfaults"]
    assert crashed.signal == "SIGSEGV"
    assert "Fatal Python error: Segmentation fault" in crashed.details
    assert "test_segfaults" in crashed.details


def test_timeout_reports_the_stack_of_the_hung_test(ladder):
    hung = ladder[0]["test_sleeps_forever"]
    assert "test_ladder.py" in hung.details and "test_sleeps_forever" in hung.details
    assert "timed out after 2s" in hung.message


def test_sigterm_ignoring_grandchild_forces_sigkill_of_the_group(ladder):
    assert "ended by sigkill" in ladder[0]["test_grandchild_ignores_sigterm"].message
    assert "ended by sigterm" in ladder[0]["test_sleeps_forever"].message


def test_each_timed_out_test_ends_within_deadline_plus_grace(ladder):
    bound = TIMEOUT_S + DUMP_WINDOW_S + GRACE_S + 1.0  # 1 s for polling and reaping on a busy machine
    for name in ("test_sleeps_forever", "test_grandchild_ignores_sigterm"):
        assert ladder[0][name].duration_s <= bound, name


def test_no_fixture_process_is_left_alive(ladder):
    _assert_no_survivors(ladder[1])


def test_only_the_infrastructure_failure_was_retried(ladder):
    results = ladder[0]
    assert results["test_infrastructure_then_passes"].attempts == 2
    assert "InfrastructureError" in results["test_infrastructure_then_passes"].details
    assert all(r.attempts == 1 for name, r in results.items() if name != "test_infrastructure_then_passes")


def test_infrastructure_failure_without_retries_stays_infrastructure(tmp_path, monkeypatch):
    results = _run(tmp_path, monkeypatch, [f"{LADDER}/test_ladder.py::test_infrastructure_then_passes"], retries=0)
    assert results["test_infrastructure_then_passes"].outcome == "infrastructure"


def test_file_isolation_runs_the_tests_after_a_crash_in_a_new_process(tmp_path, monkeypatch):
    results = _run(tmp_path, monkeypatch, [LADDER], isolate="file", timeout_s=TIMEOUT_S, grace_s=GRACE_S)
    assert {name: r.outcome for name, r in results.items()} == EXPECTED
    _assert_no_survivors(tmp_path / "work" / "state")


@pytest.mark.slow
def test_spawn_start_method_classifies_like_the_fork_server(tmp_path, monkeypatch):
    selection = ["test_passes", "test_segfaults", "test_grandchild_ignores_sigterm"]
    paths = [f"{LADDER}/test_ladder.py::{name}" for name in selection]
    results = _run(tmp_path, monkeypatch, paths, start="spawn", timeout_s=TIMEOUT_S, grace_s=GRACE_S)
    assert {name: r.outcome for name, r in results.items()} == {n: EXPECTED[n] for n in selection}
    assert results["test_segfaults"].signal == "SIGSEGV"
    _assert_no_survivors(tmp_path / "work" / "state")


def test_collection_error_is_reported_and_the_rest_still_runs(tmp_path, monkeypatch):
    results = run_tests(["tests/fixtures/suites/broken"], REPO, tmp_path,
                        RunOptions(pytest_args=FIXTURE_ARGS, preload=()))
    outcomes = {r.nodeid: r.outcome for r in results}
    assert outcomes["tests/fixtures/suites/broken/test_broken_import.py"] == "error"
    assert "module_that_does_not_exist_anywhere" in results[0].details
    assert outcomes["tests/fixtures/suites/broken/test_fine.py::test_fine"] == "passed"
    assert outcomes["tests/fixtures/suites/broken/test_fine.py::test_also_fine"] == "passed"


def test_unusable_pytest_arguments_become_one_error_result(tmp_path):
    results = run_tests(["tests/fixtures/suites/broken"], REPO, tmp_path,
                        RunOptions(pytest_args=(*FIXTURE_ARGS, "--no-such-option"), preload=()))
    assert [(r.nodeid, r.outcome) for r in results] == [("<collection>", "error")]
    assert "--no-such-option" in results[0].details


@pytest.mark.parametrize("kwargs, needle", [
    ({"isolate": "module"}, "isolate='module'"),
    ({"start": "fork"}, "start='fork'"),
    ({"timeout_s": 0}, "timeout=0"),
    ({"retries": -1}, "retries=-1"),
    ({"retries": 11}, "retries=11"),
])
def test_bad_options_are_refused(kwargs, needle):
    with pytest.raises(InvalidInputError, match=needle):
        RunOptions(**kwargs)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_GPU_COUNT", "3")  # detection overridden: this machine has no GPU
        results = _run(tmp, mp, ["tests/fixtures/suites/gpus"], gpus=None, timeout_s=60)
    records = [json.loads(p.read_text()) for p in sorted((tmp / "work" / "state").glob("*.json"))]
    return results, records


def test_tests_needing_more_gpus_than_exist_are_skipped_with_the_reason(gpu_run):
    results, records = gpu_run
    assert results["test_eight_gpus"].outcome == "skipped"
    assert results["test_eight_gpus"].message == "needs 8 GPUs, 3 available"
    assert "eight_gpus" not in {r["name"] for r in records}
    assert {n: r.outcome for n, r in results.items() if n != "test_eight_gpus"} == dict.fromkeys(
        ["test_cpu_only", *(f"test_one_gpu[{i}]" for i in range(4)), "test_two_gpus[0]", "test_two_gpus[1]",
         "test_three_gpus"], "passed")


def test_each_test_sees_exactly_the_devices_it_declared(gpu_run):
    _, records = gpu_run
    assert len(records) == 8
    for record in records:
        devices = [int(d) for d in record["cuda"].split(",") if d]
        assert len(devices) == len(set(devices)) == record["needed"], record
        assert all(0 <= d < 3 for d in devices)
        assert record["hip"] == record["cuda"]


def test_devices_are_never_shared_or_oversubscribed_but_are_used_in_parallel(gpu_run):
    _, records = gpu_run
    gpu_records = [r for r in records if r["needed"]]
    max_devices_busy = 0
    for record in gpu_records:
        at = record["start"] + 0.2  # mid-test
        busy = [r for r in gpu_records if r["start"] <= at <= r["end"]]
        in_use = [d for r in busy for d in r["cuda"].split(",")]
        assert len(in_use) == len(set(in_use)) <= 3, busy
        max_devices_busy = max(max_devices_busy, len(in_use))
    assert max_devices_busy >= 2  # one-GPU tests ran side by side on a 3-GPU budget


def test_lost_fork_server_is_infrastructure_and_the_retry_still_runs(tmp_path, monkeypatch):
    results = _run(tmp_path, monkeypatch, ["tests/fixtures/suites/lost"], timeout_s=30, retries=1)
    lost = results["test_kills_its_fork_server_once"]
    assert (tmp_path / "work" / "state" / "server-killed").exists()  # the first attempt really ran under the server
    assert (lost.outcome, lost.attempts) == ("flaky", 2)
    assert "worker lost" in lost.details


def test_a_picker_runs_its_tests_reports_its_settled_results_and_leaves_the_rest_out(tmp_path, monkeypatch):
    from kiln.tasks.testing.classify import TestResult
    from kiln.tasks.testing.jobs import Picked

    seen: list[list[str]] = []

    def pick(collected):
        seen.append(list(collected))
        passes = next(n for n in collected if n.endswith("::test_passes"))
        fails = next(n for n in collected if n.endswith("::test_assertion_fails"))
        return Picked(run=(passes,), settled=(TestResult(fails, "passed", message="carried"),))

    results = _run(tmp_path, monkeypatch, [LADDER], timeout_s=TIMEOUT_S, grace_s=GRACE_S, pick=pick)
    assert len(seen) == 1 and len(seen[0]) == len(EXPECTED)  # it saw every collected test, once
    # the settled one was reported as given (its test would fail if it ran), the others not at all
    assert {name: (r.outcome, r.message) for name, r in results.items()} == {
        "test_passes": ("passed", ""), "test_assertion_fails": ("passed", "carried")}


def test_a_collection_error_makes_the_run_carry_nothing_the_picker_settled(tmp_path):
    from kiln.tasks.testing.classify import TestResult
    from kiln.tasks.testing.jobs import Picked

    def pick(collected):  # would carry test_fine (as if it failed: a carry must never reach the report now)
        fine = next(n for n in collected if n.endswith("::test_fine"))
        return Picked(run=tuple(n for n in collected if n != fine), settled=(TestResult(fine, "failed", "carried"),))

    results = run_tests(["tests/fixtures/suites/broken"], REPO, tmp_path,
                        RunOptions(preload=(), pytest_args=FIXTURE_ARGS, pick=pick))
    outcomes = {r.nodeid: (r.outcome, r.message) for r in results}
    assert outcomes["tests/fixtures/suites/broken/test_broken_import.py"][0] == "error"
    assert outcomes["tests/fixtures/suites/broken/test_fine.py::test_fine"] == ("passed", "")  # it ran
