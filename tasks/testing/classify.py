"""Why a test ended the way it did, as a closed set of outcomes.

Only ``infrastructure`` outcomes (a lost worker, a rendezvous failure, a device
out of memory) are worth retrying; an assertion, an error in the code under
test, a timeout or a crash is a real fault and retrying it would hide a bug.
A test that needed a retry and then passed is ``flaky``, never ``passed``.

Everything here is pure: the worker turns pytest reports into plain records,
the runner turns exit statuses and ladder results into plain records, and
these functions decide the outcome from those records alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kiln.core.errors import InfrastructureError, is_retryable

Outcome = Literal["passed", "failed", "error", "skipped", "timeout", "crashed", "infrastructure", "flaky"]
OUTCOMES: tuple[Outcome, ...] = (
    "passed", "flaky", "failed", "error", "skipped", "timeout", "crashed", "infrastructure",
)
# Outcomes that make a suite fail. ``flaky`` passes but is reported as such.
FAILING: frozenset[str] = frozenset({"failed", "error", "timeout", "crashed", "infrastructure"})

# Exception types (by qualified name, so this module needs no torch) that mean
# the machine, not the code under test, failed.
INFRA_TYPE_NAMES: frozenset[str] = frozenset({
    "builtins.MemoryError",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "torch.distributed.DistStoreError",
    "torch.distributed.DistNetworkError",
    "kiln.core.errors.InfrastructureError",
})
INFRA_MESSAGES: tuple[str, ...] = ("CUDA out of memory", "HIP out of memory", "CUDA error: out of memory")
# pytest.fail() raises this (its class reports module "builtins"); a failed check, like an assertion.
ASSERTION_TYPE_NAMES: frozenset[str] = frozenset({"_pytest.outcomes.Failed", "builtins.Failed"})


@dataclass(frozen=True)
class TestResult:
    """The final word on one test (after any retries)."""

    __test__ = False  # not a pytest test class

    nodeid: str
    outcome: Outcome
    duration_s: float = 0.0
    message: str = ""   # one line, for tables and the unit message
    details: str = ""   # traceback, stacks at timeout, crash dump
    signal: str | None = None
    attempts: int = 1
    stdout: str = ""
    stderr: str = ""
    # What the test touched (kiln.tasks.testing.touch keys, sorted); () means no record, never "nothing".
    touched: tuple[str, ...] = ()


def qualified_names(exc: BaseException) -> list[str]:
    """``module.QualName`` of the exception's type and every base class."""
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__]


def is_infrastructure_exception(exc: BaseException) -> bool:
    """True for faults of the machine: retryable Kiln errors, OOM, rendezvous failures."""
    if isinstance(exc, InfrastructureError) or is_retryable(exc):
        return True
    if INFRA_TYPE_NAMES.intersection(qualified_names(exc)):
        return True
    text = str(exc)
    return any(marker in text for marker in INFRA_MESSAGES)


def is_assertion_exception(exc: BaseException) -> bool:
    return isinstance(exc, AssertionError) or bool(ASSERTION_TYPE_NAMES.intersection(qualified_names(exc)))


def first_line(text: str, limit: int = 200) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def classify_phases(nodeid: str, phases: Sequence[Mapping[str, Any]]) -> TestResult:
    """Outcome of a test from its setup/call/teardown records (as the worker writes them).

    A record has ``when``, ``outcome`` (pytest's passed/failed/skipped),
    ``kind`` ("assertion", "infrastructure", "exception" or ""), ``message``,
    ``longrepr``, ``duration`` and optional ``stdout``/``stderr``; the last may carry ``touched``.
    """
    duration = sum(float(p.get("duration", 0.0)) for p in phases)
    stdout = "".join(p.get("stdout", "") for p in phases)
    stderr = "".join(p.get("stderr", "") for p in phases)
    touched = next((tuple(sorted(map(str, p["touched"]))) for p in reversed(phases) if p.get("touched")), ())
    base = TestResult(nodeid, "passed", duration, stdout=stdout, stderr=stderr, touched=touched)
    failed = [p for p in phases if p.get("outcome") == "failed"]
    if any(p.get("kind") == "infrastructure" for p in failed):
        phase = next(p for p in failed if p.get("kind") == "infrastructure")
        return replace(base, outcome="infrastructure", message=_message(phase), details=phase.get("longrepr", ""))
    if failed:
        phase = failed[0]
        as_failure = phase.get("when") == "call" and phase.get("kind") in ("assertion", "")
        outcome: Outcome = "failed" if as_failure else "error"
        return replace(base, outcome=outcome, message=_message(phase), details=phase.get("longrepr", ""))
    skipped = next((p for p in phases if p.get("outcome") == "skipped"), None)
    if skipped is not None:
        return replace(base, outcome="skipped", message=_message(skipped))
    return base


def _message(phase: Mapping[str, Any]) -> str:
    text = phase.get("message") or first_line(phase.get("longrepr", "")) or phase.get("outcome", "")
    when = phase.get("when", "call")
    return text if when == "call" else f"in {when}: {text}"


def classify_unfinished(
    nodeid: str, *, began: bool, returncode: int | None, timed_out: bool, signal: str | None,
    stacks: str = "", lost: bool = False, duration_s: float = 0.0, timeout_s: float | None = None,
    escalation: str = "",
) -> TestResult:
    """Outcome of a test whose process ended before it wrote a result."""
    if lost:
        return TestResult(nodeid, "infrastructure", duration_s, "worker lost: the fork server went away", stacks)
    if not began:
        how = "timed out" if timed_out else f"ended with status {returncode}"
        return TestResult(nodeid, "error", 0.0, f"not run: its process {how} before the test began", stacks)
    if timed_out:
        limit = f"{timeout_s:g}s" if timeout_s is not None else f"{duration_s:.1f}s"
        ended = f"; stacks dumped, process group ended by {escalation}" if escalation else ""
        return TestResult(nodeid, "timeout", duration_s, f"timed out after {limit}{ended}", stacks)
    if signal is not None:
        return TestResult(nodeid, "crashed", duration_s, f"crashed with {signal}", stacks, signal=signal)
    return TestResult(nodeid, "crashed", duration_s, f"process exited with status {returncode} mid-test", stacks)


def merge_attempts(attempts: Sequence[TestResult]) -> TestResult:
    """One result from the attempts of one test: a pass after a retry is flaky."""
    last = attempts[-1]
    if len(attempts) == 1:
        return last
    earlier = "; ".join(f"attempt {i + 1}: {a.outcome} ({a.message})" for i, a in enumerate(attempts[:-1]))
    if last.outcome == "passed":
        return replace(last, outcome="flaky", attempts=len(attempts), message=f"passed on attempt {len(attempts)}",
                       details=earlier)
    return replace(last, attempts=len(attempts), details=f"{last.details}\n{earlier}".strip())


def should_retry(result: TestResult) -> bool:
    return result.outcome == "infrastructure"


def counts(results: Sequence[TestResult]) -> dict[str, int]:
    tally = Counter(r.outcome for r in results)
    return {outcome: tally[outcome] for outcome in OUTCOMES if tally[outcome]}


def short_name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def summary_line(results: Sequence[TestResult], limit: int = 3) -> str:
    """``"12 passed, 1 failed (test_x: assertion)"`` — the unit message."""
    if not results:
        return "no tests collected"
    text = ", ".join(f"{n} {outcome}" for outcome, n in counts(results).items())
    bad = [r for r in results if r.outcome in FAILING]
    if bad:
        reasons = "; ".join(f"{short_name(r.nodeid)}: {r.outcome}: {r.message}" for r in bad[:limit])
        more = f"; and {len(bad) - limit} more" if len(bad) > limit else ""
        text += f" ({reasons}{more})"
    return text


def suite_state(results: Sequence[TestResult]) -> Literal["completed", "failed", "flaky"]:
    if any(r.outcome in FAILING for r in results):
        return "failed"
    if any(r.outcome == "flaky" for r in results):
        return "flaky"
    return "completed"
