"""Flow runs named for what they build: ``nightly 0.1.0.dev20261202205655 @ b832b1d2bcb6``.

Prefect names a run by random words (``offbeat-myna``) unless told otherwise;
a release engineer scanning the UI's run list needs the version and the
commit. Both are known once the run's identity is computed (its record's
header, :func:`kiln.flows.run.common.open_run`), so a flow renames its own run
right after opening its record, and a dispatched run is created under the
name its flow will give itself. A release is named by its parameters alone
(``flow_run_name``), before anything runs.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from kiln.core.errors import KilnError
from kiln.core.record import Checkout, RunRecord
from kiln.tasks.project.config import load_config
from kiln.tasks.run.source import describe
from kiln.tasks.run.versioning import nightly_version

logger = logging.getLogger(__name__)
COMMIT_CHARS = 12


def at_commit(source: Checkout) -> str:
    """`` @ b832b1d2bcb6`` (`` (modified)`` when tracked files differ); "" outside git."""
    if not source.in_git or not source.commit:
        return ""
    return f" @ {source.commit[:COMMIT_CHARS]}" + (" (modified)" if source.modified else "")


def run_name(flow: str, run: RunRecord, subject: str | Iterable[str] = "") -> str:
    """``<flow> <subject> @ <commit>``; the run's version is the subject when none is given."""
    what = subject if isinstance(subject, str) else ", ".join(subject)
    return f"{flow} {what or run.header.version}{at_commit(run.header.source)}"


def release_name(parameters: Mapping[str, Any]) -> str:
    """``release 0.2.0`` (``→ nightly`` for another channel, ``(dry run)`` for a dry run)."""
    channel = parameters.get("channel", "release")
    return (f"release {parameters.get('version', '?')}" + (f" → {channel}" if channel != "release" else "")
            + (" (dry run)" if parameters.get("dry_run") else ""))


def _identity(parameters: Mapping[str, Any]) -> tuple[str, str] | None:
    """The version a run of ``parameters`` will have and its `` @ <commit>`` suffix, from the config and the
    checkout; ``None`` when either cannot be read (the flow names itself once its record exists)."""
    try:
        config = load_config(Path(parameters.get("config_path") or "kiln.toml"))
        source = describe(config.root)
        version = parameters.get("version") or nightly_version(
            config.project.version, source.commit_time if source.in_git else None)
    except (KilnError, OSError):
        return None
    return str(version), at_commit(source)


def nightly_name(parameters: Mapping[str, Any]) -> str:
    """``nightly <version> @ <commit>`` from the run's parameters and the checkout, as its record will say; just
    ``nightly`` when the config or the checkout cannot be read (the flow names itself once its record exists)."""
    identity = _identity(parameters)
    return f"nightly {identity[0]}{identity[1]}" if identity else "nightly"


def _listed(values: object, every: str) -> str:
    return ", ".join(map(str, values)) if isinstance(values, (list, tuple)) and values else every


# What each step's name says before its record exists, from its parameters; the version when it names nothing.
_SUBJECTS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "build": lambda p: _listed(p.get("variants"), "every variant"),
    "test": lambda p: _listed(p.get("paths"), "") or _listed(p.get("suites"), "every suite"),
    "bench": lambda p: "",  # its variant is chosen once its record is open
    "publish": lambda p: str(p.get("channel") or "nightly") + (" (dry run)" if p.get("dry_run") else ""),
}


def step_name(flow: str, parameters: Mapping[str, Any]) -> str:
    """``build cpu, cu130 @ <commit>``: a step's name from its first instant, before its record refines it."""
    identity = _identity(parameters)
    subject = _SUBJECTS[flow](parameters) or (identity[0] if identity else "")
    return f"{flow} {subject}".rstrip() + (identity[1] if identity else "")


def current_step_name(flow: str) -> Callable[[], str]:
    """A step flow's ``flow_run_name``: Prefect calls it with the run's parameters in context."""
    def name() -> str:
        return step_name(flow, flow_run.parameters)
    name.__name__ = f"current_{flow}_name"
    return name


def current_nightly_name() -> str:
    """The nightly's ``flow_run_name``: the name it would give itself, from the start (no random words in its
    first log line)."""
    return nightly_name(flow_run.parameters)


def current_release_name() -> str:
    """The release flows' ``flow_run_name``: Prefect calls it with the run's parameters in context."""
    return release_name(flow_run.parameters)


def name_this_run(name: str) -> None:
    """Rename the running flow run (its random name was given before its identity was known)."""
    run_id = flow_run.get_id()
    if not run_id:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(uuid.UUID(run_id), name=name)
    except Exception as exc:  # a name is a label: the run goes on without it, saying why
        logger.warning("could not name flow run %s %r: %s", run_id, name, exc)
