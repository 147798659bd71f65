"""Per-test outcomes and the quarantine list in the artifact store (``[testing.quarantine] history``).

Every suite run stores its tests' pass/fail create-only under
``<history>/outcomes/<suite>.<variant>/<UTC stamp>-<run id>.json`` (a retried task cannot rewrite
history); the quarantine list is one JSON document, ``<history>/quarantine.json``, changed only by
compare-and-swap (``put_page`` on the ETag read), so suites finishing at once each keep their change.
It is data: a test enters and leaves quarantine by the policy (:mod:`kiln.tasks.testing.flaky`), never
by an edit of the code. A quarantined test's failure turns its suite's unit from ``failed`` into
``flaky``, which does not gate publishing, and the unit's message says so.

Both are written here, by Kiln's step process after the suite's tests ended, never from inside the test
environment; and both are read through :mod:`kiln.tasks.testing.provenance`: a stored outcomes file or a list
entry that the run records it cites do not back is left out of the decision and named in the summary.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kiln.core.errors import InvalidInputError, KilnError
from kiln.core.manifest import Unit
from kiln.core.store import Store
from kiln.core.swap import until_swapped
from kiln.tasks.project.config_build import Quarantine
from kiln.tasks.testing.classify import FAILING, TestResult
from kiln.tasks.testing.flaky import (
    QuarantineList,
    RunOutcomes,
    UnitDecision,
    decide,
    excused_line,
    from_json,
    gating_line,
    quarantined_line,
    released_line,
    to_json,
)
from kiln.tasks.testing.provenance import RunRecords, check_list, check_runs, record_outcomes

_log = logging.getLogger(__name__)

CONTENT_TYPE = "application/json"
IMMUTABLE = "public, max-age=31536000, immutable"
NO_CACHE = "no-cache"
QUARANTINE = "quarantine.json"


def _prefix(policy: Quarantine) -> str:
    return policy.history.strip("/")


def quarantine_key(policy: Quarantine) -> str:
    return f"{_prefix(policy)}/{QUARANTINE}"


def outcomes_key(policy: Quarantine, unit_name: str, run: RunOutcomes) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(run.created))
    return f"{_prefix(policy)}/outcomes/{unit_name}/{stamp}-{run.run_id}.json"


def _outcomes_json(run: RunOutcomes) -> bytes:
    doc = {"run_id": run.run_id, "unit": run.unit, "commit": run.commit, "created": run.created,
           "outcomes": dict(run.outcomes)}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _parse_outcomes(data: bytes, where: str) -> RunOutcomes | None:
    try:
        doc = json.loads(data)
        outcomes = {str(k): v for k, v in doc["outcomes"].items() if v in ("pass", "fail")}
        return RunOutcomes(str(doc["run_id"]), str(doc["unit"]), str(doc["commit"]), float(doc["created"]), outcomes)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _log.warning("skipping unreadable test outcomes %s: %s", where, exc)
        return None


def store_outcomes(store: Store, policy: Quarantine, unit_name: str, run: RunOutcomes) -> str:
    key = outcomes_key(policy, unit_name, run)
    _log.info("storing %d test outcomes as %s/%s", len(run.outcomes), store.url, key)
    store.put_immutable(key, _outcomes_json(run), CONTENT_TYPE, IMMUTABLE)
    return key


def _stored_outcomes(store: Store, policy: Quarantine, unit_name: str, limit: int) -> list[tuple[str, RunOutcomes]]:
    """The newest ``limit`` stored runs of the unit with where each is, oldest first (keys sort by time)."""
    keys = store.list(f"{_prefix(policy)}/outcomes/{unit_name}/")[-limit:]
    found = []
    for key in keys:
        data = store.get(key)
        parsed = None if data is None else _parse_outcomes(data, f"{store.url}/{key}")
        if parsed is not None:
            found.append((key, parsed))
    return found


def _parse_list(data: bytes, where: str) -> QuarantineList:
    try:
        return from_json(json.loads(data))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{where} is not a Kiln quarantine list ({exc}); fix or remove it — the next "
                                f"run writes it afresh from the stored outcomes") from exc


def read_quarantine(store: Store, policy: Quarantine) -> QuarantineList:
    """The stored quarantine list; an empty one before the first flaky test."""
    key = quarantine_key(policy)
    data = store.get(key)
    return QuarantineList() if data is None else _parse_list(data, f"{store.url}/{key}")


def _history_limit(policy: Quarantine) -> int:
    return policy.window + policy.broken_after + policy.release_after + 1


def judge_run(store: Store, policy: Quarantine, unit_name: str, current: RunOutcomes) -> UnitDecision:
    """Record ``current``'s outcomes in its run record and the history, then update the quarantine list by
    compare-and-swap and say what changed; only outcomes and entries the run records back are used."""
    record_outcomes(store, current)
    store_outcomes(store, policy, unit_name, current)
    records = RunRecords(store)
    history, ignored = check_runs(records, _stored_outcomes(store, policy, unit_name, _history_limit(policy)))
    key = quarantine_key(policy)

    def attempt() -> UnitDecision:
        page = store.get_page(key)
        stored = QuarantineList() if page is None else _parse_list(page[0], f"{store.url}/{key}")
        before, dropped = check_list(records, stored, lambda e: e.unit == current.unit)
        decision = decide(before, history, current, policy)
        if decision.quarantined or decision.released or decision.gating or dropped:
            data = (json.dumps(to_json(decision.quarantine), indent=2) + "\n").encode()
            store.put_page(key, data, CONTENT_TYPE, NO_CACHE, None if page is None else page[1])
        return replace(decision, ignored=(*ignored, *dropped))

    return until_swapped(f"{store.url}/{key}", attempt)


@dataclass(frozen=True)
class Judged:
    """A suite unit after the quarantine policy, and the summary's lines about it."""

    unit: Unit
    lines: tuple[str, ...]


def apply(unit: Unit, results: Sequence[TestResult], decision: UnitDecision) -> Judged:
    """``unit`` with failures of quarantined tests excused: ``failed`` becomes ``flaky`` when they were
    all its failures; the lines name every excused, newly quarantined and released test."""
    excused = {e.nodeid for e in decision.excused}
    lines = ([excused_line(e) for e in decision.excused] + [quarantined_line(e) for e in decision.quarantined
                                                              if e.nodeid not in excused]
             + [released_line(e, n) for e, n in decision.released]
             + [gating_line(e, why) for e, why in decision.gating] + list(decision.ignored))
    failing = {r.nodeid for r in results if r.outcome in FAILING}
    if not lines:
        return Judged(unit, ())
    message = "\n".join([unit.message, *lines])
    if unit.state == "failed" and failing and failing <= excused:
        return Judged(replace(unit, state="flaky", message=message), tuple(lines))
    return Judged(replace(unit, message=message), tuple(lines))


def rows(quarantine: QuarantineList) -> list[dict[str, object]]:
    """The quarantine list as table rows (the nightly's Prefect artifact, ``kiln quarantine``)."""
    return [{"unit": e.unit, "test": e.nodeid, "why": e.reason, "since run": e.since_run,
             "since": time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.since))} for e in quarantine.entries]


def judge_suite(store: Store, policy: Quarantine, *, run_id: str, commit: str, created: float, unit_name: str,
                unit: Unit, results: Sequence[TestResult]) -> Judged:
    """The suite's unit after the policy (off, or a suite that did not run: unchanged).

    The list cannot be read or written: the unit is left as it is (its failures gate, the safe way)
    and a line says why, never a failed suite for a bookkeeping fault.
    """
    if not policy.enabled or unit.state in ("not_run", "skipped") or not results:
        return Judged(unit, ())
    current = RunOutcomes.of(run_id, unit.id, commit, created, results)
    try:
        decision = judge_run(store, policy, unit_name, current)
    except KilnError as exc:
        _log.warning("test quarantine not applied to %s: %s", unit.id, exc)
        return Judged(unit, (f"quarantine not applied: {exc}",))
    return apply(unit, results, decision)


def render(quarantine: QuarantineList, where: str) -> str:
    """``kiln quarantine``: each quarantined test, why and since when, as plain text."""
    if not quarantine.entries:
        return f"no test is quarantined ({where})\n"
    count = len(quarantine.entries)
    lines = [f"{count} quarantined test{'s' if count != 1 else ''} ({where}): they run and are reported, "
             "and their failures do not gate publishing"]
    for row in rows(quarantine):
        lines += [f"  {row['unit']}  {row['test']}", f"    {row['why']}; since run {row['since run']} ({row['since']})"]
    return "\n".join(lines) + "\n"
