"""Helpers every Kiln flow uses: the run manifest, unit tables, final states.

A flow decides order, isolation and final state; these helpers make the
last two uniform: every stage records its units in ``run.json``, leaves a
table artifact of them, and ends Failed with "N of M units failed" when any
unit failed, so the Prefect UI and the manifest always agree.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Iterable

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State

from release.errors import is_retryable
from release.manifest import MANIFEST_NAME, RunManifest, Unit

logger = logging.getLogger("kiln.flows")

TABLE_COLUMNS = ("id", "state", "variant", "arch", "kernel", "suite", "cache", "duration_s", "message")


def open_run(out: str | Path, flow_name: str, version: str = "") -> RunManifest:
    """Load ``<out>/run.json`` if a previous stage of this run wrote it, else start one."""
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if (root / MANIFEST_NAME).exists():
        run = RunManifest.load(root)
        if version and not run.version:
            run.version = version
        return run
    run_id = str(flow_run.get_id() or uuid.uuid4())
    run = RunManifest(root=root, run_id=run_id, flow=flow_name, version=version)
    run.save()
    return run


def record(run: RunManifest, unit: Unit) -> Unit:
    """Add ``unit`` and persist the manifest at once, so a crash loses nothing."""
    run.add_unit(unit)
    run.save()
    return unit


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


def stage_summary(run: RunManifest, stage: str) -> dict[str, int]:
    units = [u for u in run.units if u.stage == stage]
    counts: dict[str, int] = {"total": len(units)}
    for unit in units:
        counts[unit.state] = counts.get(unit.state, 0) + 1
    return counts


def publish_unit_table(run: RunManifest, units: list[Unit], key: str, title: str) -> None:
    """A table artifact of ``units``; a reporting failure never fails the run."""
    try:
        create_table_artifact(key=key, table=unit_rows(units), description=f"{title} — run {run.run_id}")
    except Exception as exc:  # side report only: log and go on (invariant 4)
        logger.warning("could not create the %s table artifact: %s", key, exc)


def finish_stage(run: RunManifest, stage: str, title: str) -> dict[str, int] | State:
    """Persist the manifest, leave a table of the stage's units, choose the final state."""
    run.save()
    units = [u for u in run.units if u.stage == stage]
    publish_unit_table(run, units, f"kiln-{stage}-units", title)
    if any(u.state == "failed" for u in units):
        message = failure_message(title, units)
        logger.error(message)
        # No ``data=``: a Failed state's data is what Prefect raises when the flow is
        # called without return_state, and it must be an exception, not a dict.
        return Failed(message=message)
    return stage_summary(run, stage)


def markdown_report(key: str, markdown: str, description: str) -> None:
    try:
        create_markdown_artifact(key=key, markdown=markdown, description=description)
    except Exception as exc:  # side report only
        logger.warning("could not create the %s markdown artifact: %s", key, exc)


def retry_on_retryable(task: Any, task_run: Any, state: State) -> bool:
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
