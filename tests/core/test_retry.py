"""retry_on_retryable through Prefect: permanent errors run once, transient ones are retried (invariant 5).

Each case runs a real task with ``retry_condition_fn=retry_on_retryable`` in a
flow on the session's Prefect test server and counts how often the task body
ran, so the test checks what Prefect does with the condition, not only what
the helper returns.
"""

from __future__ import annotations

import builtins
import inspect

import pytest
from prefect import flow, task

from kiln.core import errors
from kiln.core.errors import KilnError
from kiln.flows.run.common import retry_on_retryable

RETRIES = 3

PERMANENT = [
    errors.PermanentError, errors.InvalidInputError, errors.ConfigError, errors.IntegrityError,
    errors.AlreadyPublishedError, errors.AccessDeniedError, errors.FetchError, errors.BuildWorkerError,
    errors.CompileError, errors.ToolchainMissingError, errors.DistributedTestError,
    errors.TestTimeoutError, errors.RegressionError, errors.BenchmarkError,
    errors.MemberTooLargeError, errors.RecordMismatchError, errors.UnsafePathError,
    errors.LinkRefusedError, errors.TooLargeError, errors.AbiAuditError,
]
TRANSIENT = [
    errors.RetryableError, errors.ThrottledError, errors.TransientStoreError, errors.ConflictError,
    errors.CacheDriftError, errors.InfrastructureError, errors.WorkerLostError,
]

_calls: dict[str, int] = {}


@task(retries=RETRIES, retry_delay_seconds=0, retry_condition_fn=retry_on_retryable)
def flaky(key: str, error: str, failures: int) -> str:
    """Raise the error type named ``error`` on the first ``failures`` calls, then succeed."""
    _calls[key] = _calls.get(key, 0) + 1
    if _calls[key] <= failures:
        raise _make(error, f"injected failure {_calls[key]} of {failures}")
    return "done"


def _make(error: str, message: str) -> BaseException:
    """An instance of the error type named ``error`` (a Kiln type, else a builtin one)."""
    if error == "BuildWorkerError":  # its message is built from the worker, target and the worker's error
        return errors.BuildWorkerError("worker-0", "k/sm_90", "ImportError", message)
    return (getattr(errors, error, None) or getattr(builtins, error))(message)


@flow(name="retry-check")
def run_flaky(key: str, error: str, failures: int) -> str:
    """The task's final state type; returning the state itself would fail the flow with it."""
    return flaky(key, error, failures, return_state=True).type.value


def _run(request: pytest.FixtureRequest, error: type[BaseException], failures: int) -> tuple[str, int]:
    """(the task's final state type, calls of its body); names cross the API, not classes."""
    key = request.node.name
    _calls.pop(key, None)
    return run_flaky(key, error.__name__, failures), _calls.get(key, 0)


def test_the_tables_classify_every_kiln_error_type() -> None:
    declared = {cls for _, cls in inspect.getmembers(errors, inspect.isclass) if issubclass(cls, KilnError)}
    assert declared - {KilnError} == set(PERMANENT) | set(TRANSIENT)


@pytest.mark.slow
@pytest.mark.parametrize("error", PERMANENT, ids=lambda e: e.__name__)
def test_a_permanent_error_fails_its_task_after_one_call(prefect_server, request, error) -> None:
    state, calls = _run(request, error, failures=RETRIES + 1)
    assert (state, calls) == ("FAILED", 1)


@pytest.mark.slow
@pytest.mark.parametrize("error", [ValueError, AssertionError], ids=lambda e: e.__name__)
def test_an_unclassified_error_is_not_retried(prefect_server, request, error) -> None:
    state, calls = _run(request, error, failures=RETRIES + 1)
    assert (state, calls) == ("FAILED", 1)


@pytest.mark.slow
@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: e.__name__)
def test_a_transient_error_is_retried_until_the_task_succeeds(prefect_server, request, error) -> None:
    state, calls = _run(request, error, failures=RETRIES)
    assert (state, calls) == ("COMPLETED", RETRIES + 1)


@pytest.mark.slow
def test_a_transient_error_that_persists_stops_after_the_bounded_retries(prefect_server, request) -> None:
    state, calls = _run(request, errors.ThrottledError, failures=RETRIES + 5)
    assert (state, calls) == ("FAILED", RETRIES + 1)
