"""Test outcomes and quarantine entries checked against the run records they cite.

The history of per-test outcomes and the quarantine list are plain objects in the artifact store: anything
that can write there (a test's code reaching the store, a confused operator) could add a run that never
happened or an entry that excuses a test forever. So Kiln's own step process records each suite run's
outcomes a second time, create-only, in that run's record (info ``test-outcomes:<unit id>``, beside the
header Kiln wrote when the run started), and a stored outcomes file or list entry counts only when every
run it cites exists, built the commit it names, started when it says, and recorded the outcome it claims.
What does not check out is left out of every decision and reported, never trusted and never fatal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.record import RunHeader, info_json, info_key, load_header, load_info
from kiln.core.store import Store
from kiln.tasks.testing.flaky import Entry, Evidence, QuarantineList, RunOutcomes

OUTCOMES_INFO = "test-outcomes:"  # run info key prefix (+ unit id): the suite's outcomes as the step recorded them
CONTENT_TYPE = "application/json"


def outcomes_info_key(unit: str) -> str:
    return f"{OUTCOMES_INFO}{unit}"


def record_outcomes(store: Store, run: RunOutcomes) -> None:
    """Record ``run``'s outcomes in its run record, create-only: a second, different record is an
    :class:`IntegrityError` (someone wrote it first), so the first writer's outcomes stand."""
    key = outcomes_info_key(run.unit)
    store.put_immutable(info_key(run.run_id, key), info_json(key, dict(run.outcomes)), CONTENT_TYPE, "no-cache")


@dataclass
class RunRecords:
    """Run headers and recorded outcomes read from the store, each once."""

    store: Store
    _headers: dict[str, RunHeader | None] = field(default_factory=dict)
    _outcomes: dict[tuple[str, str], object] = field(default_factory=dict)

    def header(self, run_id: str) -> RunHeader | None:
        if run_id not in self._headers:
            self._headers[run_id] = load_header(self.store, run_id)
        return self._headers[run_id]

    def outcomes(self, run_id: str, unit: str) -> object:
        if (run_id, unit) not in self._outcomes:
            self._outcomes[(run_id, unit)] = load_info(self.store, run_id, outcomes_info_key(unit))
        return self._outcomes[(run_id, unit)]


def _commit_problem(header: RunHeader, commit: str) -> str:
    """Why ``header``'s run does not name ``commit`` (its clean commit, or none), or ""."""
    built = header.source.commit if header.source.clean else ""
    if built != commit:
        return f"it names commit {commit[:12] or '(none)'}, the run record says {built[:12] or '(none)'}"
    return ""


def _header(records: RunRecords, run_id: str, commit: str) -> RunHeader | str:
    """Run ``run_id``'s header when it backs a claim about ``commit``, else why not."""
    try:
        header = records.header(run_id)
    except (InvalidInputError, IntegrityError) as exc:
        return f"its run {run_id!r} cannot be read ({exc})"
    if header is None:
        return f"run {run_id} has no record in {records.store.url}"
    return _commit_problem(header, commit) or header


def _recorded(records: RunRecords, run_id: str, unit: str) -> dict[str, object] | str:
    """The outcomes run ``run_id`` recorded for ``unit``, or why there are none to check against."""
    try:
        found = records.outcomes(run_id, unit)
    except InvalidInputError as exc:
        return f"run {run_id}'s recorded outcomes cannot be read ({exc})"
    if not isinstance(found, dict):
        return f"run {run_id} recorded no outcomes of {unit}"
    return found


def outcomes_problem(records: RunRecords, run: RunOutcomes) -> str:
    """Why a stored outcomes file does not match the run record it cites, or ""."""
    header = _header(records, run.run_id, run.commit)
    if isinstance(header, str):
        return header
    if header.created != run.created:
        return f"it says the run started at {run.created}, the run record says {header.created}"
    recorded = _recorded(records, run.run_id, run.unit)
    if isinstance(recorded, str):
        return recorded
    differ = sorted(k for k in {*recorded, *run.outcomes} if recorded.get(k) != run.outcomes.get(k))
    return f"its outcomes differ from those run {run.run_id} recorded ({', '.join(differ[:3])})" if differ else ""


def _evidence_problem(records: RunRecords, entry: Entry, evidence: Evidence) -> str:
    header = _header(records, evidence.run_id, evidence.commit)
    if isinstance(header, str):
        return header
    recorded = _recorded(records, evidence.run_id, entry.unit)
    if isinstance(recorded, str):
        return recorded
    if recorded.get(entry.nodeid) != evidence.verdict:
        return (f"it cites a {evidence.verdict} in run {evidence.run_id}, which recorded "
                f"{recorded.get(entry.nodeid) or 'no outcome'}")
    return ""


def entry_problem(records: RunRecords, entry: Entry) -> str:
    """Why a quarantine list entry is not backed by the runs it cites, or ""."""
    for evidence in entry.record:
        problem = _evidence_problem(records, entry, evidence)
        if problem:
            return problem
    by_commit: dict[str, set[str]] = {}
    for evidence in entry.record:
        by_commit.setdefault(evidence.commit, set()).add(evidence.verdict)
    if not any(commit and verdicts == {"pass", "fail"} for commit, verdicts in by_commit.items()):
        return "it cites no pass and fail on one commit"
    return ""


def check_runs(records: RunRecords, runs: Sequence[tuple[str, RunOutcomes]]) -> tuple[list[RunOutcomes], list[str]]:
    """The ``(where, outcomes)`` that match their run records, and why each other one is ignored."""
    kept, ignored = [], []
    for where, run in runs:
        problem = outcomes_problem(records, run)
        if problem:
            ignored.append(f"ignored test outcomes {where}: {problem}")
        else:
            kept.append(run)
    return kept, ignored


def check_list(records: RunRecords, quarantine: QuarantineList,
               keep: Callable[[Entry], bool] = lambda _: True) -> tuple[QuarantineList, list[str]]:
    """``quarantine`` without the entries (of the units ``keep`` selects) that do not check out, and why."""
    kept, ignored = [], []
    for entry in quarantine.entries:
        problem = entry_problem(records, entry) if keep(entry) else ""
        if problem:
            ignored.append(f"ignored quarantine entry {entry.unit} {entry.nodeid}: {problem}")
        else:
            kept.append(entry)
    return replace(quarantine, entries=tuple(kept)), ignored
