"""kiln.tasks.testing.classify: outcomes from phase records, exits, and retries."""

from __future__ import annotations

import pytest

from kiln.core.errors import CompileError, InfrastructureError, ThrottledError
from kiln.tasks.testing.classify import (
    TestResult,
    classify_phases,
    classify_unfinished,
    is_assertion_exception,
    is_infrastructure_exception,
    merge_attempts,
    should_retry,
    suite_state,
    summary_line,
)


def phase(when="call", outcome="passed", kind="", message="", longrepr=""):
    return {"when": when, "outcome": outcome, "kind": kind, "message": message, "longrepr": longrepr, "duration": 0.1}


@pytest.mark.parametrize("phases, expected", [
    ([phase("setup"), phase(), phase("teardown")], "passed"),
    ([phase("setup"), phase(outcome="failed", kind="assertion"), phase("teardown")], "failed"),
    ([phase("setup"), phase(outcome="failed", kind="exception"), phase("teardown")], "error"),
    ([phase("setup", outcome="failed", kind="assertion")], "error"),  # a broken fixture is not a failed check
    ([phase("setup"), phase(), phase("teardown", outcome="failed", kind="exception")], "error"),
    ([phase("setup"), phase(outcome="failed", kind="infrastructure"), phase("teardown")], "infrastructure"),
    ([phase("setup", outcome="failed", kind="infrastructure")], "infrastructure"),
    ([phase("setup", outcome="skipped", message="no GPU")], "skipped"),
    ([phase("setup"), phase(outcome="failed", kind="")], "failed"),  # strict xpass: pytest's own failure
])
def test_phase_records_map_to_one_outcome(phases, expected):
    assert classify_phases("t.py::t", phases).outcome == expected


def test_failure_message_comes_from_the_failing_phase():
    result = classify_phases("t.py::t", [phase("setup", outcome="failed", kind="exception", message="KeyError: 'x'")])
    assert result.message == "in setup: KeyError: 'x'"


@pytest.mark.parametrize("exc, infra", [
    (InfrastructureError("worker lost"), True),
    (ThrottledError("slow down"), True),       # any retryable Kiln error is the machine's fault
    (MemoryError(), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (CompileError("bad kernel"), False),
    (AssertionError("wrong sum"), False),
    (ValueError("bad"), False),
])
def test_infrastructure_exceptions(exc, infra):
    assert is_infrastructure_exception(exc) is infra


def test_torch_out_of_memory_is_infrastructure():
    torch = pytest.importorskip("torch")
    assert is_infrastructure_exception(torch.OutOfMemoryError("CUDA OOM"))


def test_pytest_fail_counts_as_an_assertion():
    with pytest.raises(BaseException) as info:
        pytest.fail("checked and wrong")
    assert is_assertion_exception(info.value)
    assert not is_assertion_exception(ValueError())


@pytest.mark.parametrize("kwargs, outcome, message", [
    ({"began": True, "returncode": -11, "timed_out": False, "signal": "SIGSEGV"}, "crashed", "crashed with SIGSEGV"),
    ({"began": True, "returncode": -15, "timed_out": True, "signal": "SIGTERM", "timeout_s": 2.0,
      "escalation": "sigterm"}, "timeout", "timed out after 2s; stacks dumped, process group ended by sigterm"),
    ({"began": True, "returncode": 3, "timed_out": False, "signal": None}, "crashed",
     "process exited with status 3 mid-test"),
    ({"began": True, "returncode": -9, "timed_out": False, "signal": "SIGKILL", "lost": True}, "infrastructure",
     "worker lost: the fork server went away"),
    ({"began": False, "returncode": 1, "timed_out": False, "signal": None}, "error",
     "not run: its process ended with status 1 before the test began"),
])
def test_unfinished_tests(kwargs, outcome, message):
    result = classify_unfinished("t.py::t", **kwargs)
    assert (result.outcome, result.message) == (outcome, message)


def test_pass_after_infrastructure_failure_is_flaky_with_the_history():
    merged = merge_attempts([TestResult("t", "infrastructure", message="worker lost"), TestResult("t", "passed")])
    assert (merged.outcome, merged.attempts) == ("flaky", 2)
    assert "attempt 1: infrastructure (worker lost)" in merged.details


def test_the_first_failing_phase_is_reported_and_durations_add_up():
    phases = [phase("setup", outcome="failed", kind="exception", message="KeyError: 'x'"),
              phase("teardown", outcome="failed", kind="exception", message="OSError: busy")]
    phases[0]["duration"], phases[1]["duration"] = 0.25, 0.5
    result = classify_phases("t.py::t", phases)
    assert (result.outcome, result.message, result.duration_s) == ("error", "in setup: KeyError: 'x'", 0.75)
    # a record without a duration (an older worker) adds nothing
    assert classify_phases("t.py::t", [{"when": "call", "outcome": "passed"}]).duration_s == 0.0


def test_an_unfinished_test_takes_the_time_it_ran_and_one_never_begun_took_none():
    crashed = classify_unfinished("t.py::t", began=True, returncode=-11, timed_out=False, signal="SIGSEGV")
    assert crashed.duration_s == 0.0
    not_run = classify_unfinished("t.py::t", began=False, returncode=1, timed_out=False, signal=None, duration_s=4.0)
    assert not_run.duration_s == 0.0


def test_a_single_attempt_is_its_own_result():
    for outcome in ("passed", "failed"):
        only = TestResult("t", outcome, message="m", details="d")
        assert merge_attempts([only]) == only


def test_a_pass_on_the_third_attempt_keeps_every_earlier_attempt():
    merged = merge_attempts([TestResult("t", "infrastructure", message="lost 1"),
                             TestResult("t", "infrastructure", message="lost 2"), TestResult("t", "passed")])
    assert (merged.outcome, merged.attempts, merged.message) == ("flaky", 3, "passed on attempt 3")
    assert merged.details == "attempt 1: infrastructure (lost 1); attempt 2: infrastructure (lost 2)"
    failed = merge_attempts([TestResult("t", "infrastructure"), TestResult("t", "passed"),
                             TestResult("t", "failed", message="assert")])
    assert (failed.outcome, failed.message) == ("failed", "assert")


def test_repeated_failure_keeps_the_last_outcome():
    merged = merge_attempts([TestResult("t", "infrastructure"), TestResult("t", "failed", message="assert")])
    assert (merged.outcome, merged.attempts) == ("failed", 2)


@pytest.mark.parametrize("outcome, retry", [
    ("infrastructure", True), ("failed", False), ("error", False), ("timeout", False), ("crashed", False),
    ("passed", False), ("skipped", False),
])
def test_only_infrastructure_is_retried(outcome, retry):
    assert should_retry(TestResult("t", outcome)) is retry


def test_summary_line_counts_and_names_failures():
    results = [TestResult(f"a.py::t{i}", "passed") for i in range(12)]
    results.append(TestResult("a.py::test_x", "failed", message="assert 1 == 2"))
    assert summary_line(results) == "12 passed, 1 failed (test_x: failed: assert 1 == 2)"


@pytest.mark.parametrize("outcomes, state", [
    (["passed", "skipped"], "completed"),
    (["passed", "flaky"], "flaky"),
    (["flaky", "timeout"], "failed"),
    ([], "completed"),
])
def test_suite_state(outcomes, state):
    assert suite_state([TestResult(str(i), o) for i, o in enumerate(outcomes)]) == state
