"""Helpers every Kiln flow uses: the run record, unit tables, final states.

A flow decides order, isolation and final state; these helpers make the
last two uniform: every stage records its units in the run's record (in the
artifact store, see :mod:`kiln.core.record`), leaves a table artifact of
them, and ends Failed with "N of M units failed" when any unit failed. A
unit is recorded from its Prefect task's *final* state, by the flow, so the
record and the UI always agree.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import platform
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

from prefect import State, Task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.schemas.objects import TaskRun
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from prefect.states import Failed, get_state_result
from prefect.utilities.annotations import quote
from prefect.utilities.asyncutils import run_coro_as_sync

from kiln.core.errors import is_retryable
from kiln.core.manifest import Unit
from kiln.core.objects import BotoSession
from kiln.core.record import RunRecord
from kiln.core.sandbox import CONFINEMENT_INFO, STAGE_NETWORK, confinement
from kiln.flows.run import cancel
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.coverage import COVERAGE_INFO, coverage_rows
from kiln.tasks.run.runs import artifact_store, check_checkout, continue_run, start_run

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Every process that runs a Kiln flow imports this module before the flow starts (a deployment
# run's too): from then on a SIGTERM ends the groups Kiln started before the run unwinds.
cancel.arm()

# The id, state and message lead: a release engineer reads those first; details follow.
TABLE_COLUMNS = ("id", "state", "message", "variant", "arch", "kernel", "suite", "cache", "duration_s")


def store_session(config: KilnConfig, step: str, kind: str = "s3", *,
                  read_only: bool = False) -> BotoSession | None:
    """The boto3 session ``step`` reaches a store of ``kind`` with (its own ``[permissions]`` credentials,
    narrowed to reads with ``read_only``); None for a local store. The one place a flow opens credentials:
    boto3 is imported only for S3."""
    if kind != "s3":
        return None
    from kiln.flows.run.credentials import session_for

    session: BotoSession = session_for(config, step, read_only=read_only)  # a boto3.Session: untyped, so named
    return session


def open_run(config: KilnConfig, flow_name: str, out: str | Path, *, run_id: str | None = None,
             version: str | None = None, ref: str = "", step: str = "build", commit: str = "") -> RunRecord:
    """The run this flow belongs to: ``run_id``'s record, or a new one named after this flow run.

    ``ref``: what a new run records as its source ref (default: its commit). ``commit``: the
    commit the run names, which this checkout must be at (a dispatched unit's worker).
    """
    check_checkout(config, commit)
    store = artifact_store(config, store_session(config, step, config.artifacts.kind))
    if run_id:
        return continue_run(store, run_id, out)
    new_id = str(flow_run.get_id() or uuid.uuid4())
    return start_run(config, store, run_id=new_id, flow=flow_name, out=out, version=version, ref=ref)


def record(run: RunRecord, unit: Unit) -> Unit:
    """Write ``unit`` to the run's record at once, so a crash loses nothing."""
    return run.record(unit)


def unwalked(value: T) -> T:
    """``value`` as a task argument that Prefect hands over as it is, without walking it (``quote``).

    Prefect visits every nested object of an argument to find futures and
    upstream results, twice per task run; for a unit's environment or a build
    plan that is most of a cached unit's cost. Only for values that hold no futures.
    """
    return cast(T, quote(value))


def results_of(futures: Iterable[PrefectFuture[T]]) -> list[T | BaseException]:
    """Each finished future's result (a failed one's exception), like ``f.result(raise_on_failure=False)``.

    Read in one trip to Prefect's event loop thread instead of one per future:
    for the 109 cached units of a warm build, 0.3 s less.
    """
    states = []
    for future in futures:
        future.wait()
        states.append(future.state)

    async def read_all() -> list[T | BaseException]:
        return list(await asyncio.gather(*(get_state_result(s, raise_on_failure=False) for s in states)))

    return run_coro_as_sync(read_all()) or []


def sync_state(value: object) -> State:
    """The state a flow or task called with ``return_state=True`` from sync code returned.

    Prefect types such a call as "a state or an awaitable of one"; from sync code it is always a state.
    """
    if not isinstance(value, State):
        raise TypeError(f"expected the state of a sync call, got {type(value).__name__}")
    return value


def unit_from_state(template: Unit, state: State) -> Unit:
    """The unit a task's final state stands for: its returned unit, or ``template`` failed with the reason."""
    value = state.result(raise_on_failure=False) if state.is_completed() or state.is_failed() else None
    # A task that judged its unit failed returns ``Failed(data=unit)``: the unit is its own verdict.
    if isinstance(value, Unit) and (state.is_completed() or value.state == "failed"):
        return value
    if isinstance(value, BaseException):
        reason = f"{type(value).__name__}: {value}"
    else:
        reason = state.message or f"task ended {state.name}"
    return replace(template, state="failed", message=reason)


def unit_rows(units: Iterable[Unit]) -> list[dict[str, Any]]:
    rows = []
    for unit in sorted(units, key=lambda u: u.id):
        row = {column: getattr(unit, column) for column in TABLE_COLUMNS}
        row["duration_s"] = round(unit.duration_s, 2)
        row = {key: ("" if value is None else value) for key, value in row.items()}
        rows.append(row)
    return rows


def failure_message(title: str, units: list[Unit]) -> str:
    failed = [u for u in units if u.state == "failed"]
    head = f"{title}: {len(failed)} of {len(units)} units failed"
    details = "; ".join(f"{u.id}: {u.message.splitlines()[0] if u.message else 'failed'}" for u in failed[:5])
    more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
    return f"{head} — {details}{more}"


def stage_summary(units: list[Unit]) -> dict[str, int]:
    counts: dict[str, int] = {"total": len(units)}
    for unit in units:
        counts[unit.state] = counts.get(unit.state, 0) + 1
    return counts


def publish_unit_table(run: RunRecord, units: list[Unit], key: str, title: str) -> None:
    """A table artifact of ``units``; a reporting failure never fails the run."""
    try:
        create_table_artifact(key=key, table=unit_rows(units), description=f"{title} — run {run.run_id}")
    except Exception as exc:  # side report only: log and go on (invariant 4)
        logger.warning("could not create the %s table artifact: %s", key, exc)


def finish_stage(run: RunRecord, stage: str, title: str,
                 mine: Callable[[Unit], bool] | None = None) -> dict[str, int] | State:
    """Leave a table of the stage's units, write the local view, choose the final state.

    ``mine`` picks this flow's own units when others of the stage share the run
    (a variant's build or a suite dispatched to a worker, beside the rest).
    """
    units = [u for u in run.units() if u.stage == stage and (mine is None or mine(u))]
    publish_unit_table(run, units, f"kiln-{stage}-units", title)
    if stage in STAGE_NETWORK:  # the steps that run package code: how this machine confined it
        run.set_info(f"{CONFINEMENT_INFO}{stage}@{platform.node()}", confinement(STAGE_NETWORK[stage]))
    run.write_view()
    if any(u.state == "failed" for u in units):
        message = failure_message(title, units)
        logger.error(message)
        # No ``data=``: a Failed state's data is what Prefect raises when the flow is
        # called without return_state, and it must be an exception, not a dict.
        return Failed(message=message)
    return stage_summary(units)


@contextmanager
def side_reports() -> Iterator[Callable[..., object]]:
    """``report(fn, *args)`` runs ``fn`` on a thread, in this run's context, while the flow goes on.

    For side reports (artifacts: one request each to the server, 60-90 ms on a
    busy local one) that nothing after them reads; each catches its own errors,
    and one that raises all the same is logged, never lost. All have been sent
    when the block ends.
    """
    sent: list[Future[object]] = []
    with ThreadPoolExecutor(2, thread_name_prefix="kiln-report") as pool:
        yield lambda fn, *args: sent.append(pool.submit(contextvars.copy_context().run, fn, *args))
    for future in sent:
        if (exc := future.exception()) is not None:
            logger.warning("a side report failed: %s: %s", type(exc).__name__, exc)


def markdown_report(key: str, markdown: str, description: str) -> None:
    try:
        create_markdown_artifact(key=key, markdown=markdown, description=description)
    except Exception as exc:  # side report only
        logger.warning("could not create the %s markdown artifact: %s", key, exc)


def artifact_key(prefix: str, name: str) -> str:
    """A valid Prefect artifact key (lowercase letters, digits and dashes) for ``name``."""
    return f"{prefix}-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "x")


def table_report(key: str, rows: list[dict[str, Any]], description: str) -> str:
    """A table artifact; its address in the Prefect UI ("" when it could not be created: a side report)."""
    try:
        # Called from sync code, so Prefect's sync-or-async function returned the id itself.
        artifact_id = cast(uuid.UUID, create_table_artifact(key=key, table=rows, description=description))
    except Exception as exc:  # side report only: log and go on (invariant 4)
        logger.warning("could not create the %s table artifact: %s", key, exc)
        return ""
    return artifact_url(artifact_id)


def coverage_report(config: KilnConfig, run: RunRecord, flow: str) -> list[dict[str, str]]:
    """Record the run's coverage table (one row per requested cell) for the summary, and leave it as a table
    artifact; returns the rows."""
    rows = [row.as_dict() for row in coverage_rows(config, run.manifest())]
    run.set_info(COVERAGE_INFO, rows)
    table_report(f"kiln-{flow}-coverage", rows, f"Coverage: every requested cell and its wheel — run {run.run_id}")
    return rows


def artifact_url(artifact_id: uuid.UUID | str) -> str:
    """The artifact's page in the Prefect UI; relative to the UI when no UI URL is configured."""
    base = (get_current_settings().ui_url or "").rstrip("/")
    return f"{base}/artifacts/artifact/{artifact_id}"


def retry_on_retryable(task: Task[..., Any], task_run: TaskRun, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry only Kiln's retryable error types.

    Permanent errors (compile error, assertion, hash mismatch, permission
    denied) and anything Kiln did not classify fail at once (invariant 5).
    """
    try:
        state.result(raise_on_failure=True)
    except Exception as exc:
        retry = is_retryable(exc)
        logger.info("%s: %s is %s", getattr(task_run, "name", "task"), type(exc).__name__,
                    "retryable — retrying" if retry else "permanent — not retrying")
        return retry
    return False
