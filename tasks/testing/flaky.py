"""Flaky tests and their quarantine, decided from the stored per-test outcomes (``[testing.quarantine]``).

Pure: every function here takes the outcomes of earlier runs and the quarantine list as data and returns
the new list; :mod:`kiln.tasks.testing.quarantine` reads and writes them in the artifact store.

A test is **flaky** when it passed and failed on one commit (the code did not change, the outcome did)
within its last ``window`` runs. A flaky test is quarantined: it still runs and is reported, but its
failure does not gate publishing. ``release_after`` consecutive passes since it was quarantined end the
quarantine, and so does the window moving past its last same-commit pass and fail (it expires); evidence
from before a release is not held against it again. A test that fails on ``broken_after`` consecutive
commits is broken, not flaky: it is never quarantined, and a quarantined one leaves and gates again.

The runs and the list given here must already be checked against the run records they cite
(:mod:`kiln.tasks.testing.quarantine`): this module trusts its inputs.

Tests are keyed per unit (``test/<suite>/<variant>``) and node id: one variant's flaky test says nothing
about the same test on other hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kiln.tasks.project.config_build import Quarantine
from kiln.tasks.testing.classify import FAILING, TestResult

Verdict = Literal["pass", "fail"]


def verdict(outcome: str) -> Verdict | None:
    """What a test outcome counts as: a pass (``flaky`` passed on an infrastructure retry), a fail, or
    nothing (skipped)."""
    if outcome in ("passed", "flaky"):
        return "pass"
    return "fail" if outcome in FAILING else None


@dataclass(frozen=True)
class RunOutcomes:
    """One run of one suite unit: which commit, when, and each test's pass or fail."""

    run_id: str
    unit: str
    commit: str  # "" when the run's tree was not a clean commit: then no same-commit evidence
    created: float  # the run's start, Unix seconds: orders runs and releases
    outcomes: Mapping[str, Verdict]

    @classmethod
    def of(cls, run_id: str, unit: str, commit: str, created: float,
           results: Iterable[TestResult]) -> RunOutcomes:
        found = {r.nodeid: verdict(r.outcome) for r in results}
        return cls(run_id, unit, commit, created, {k: v for k, v in sorted(found.items()) if v is not None})


@dataclass(frozen=True)
class Evidence:
    """One run's outcome of one test: part of a flaky test's record."""

    run_id: str
    commit: str
    verdict: Verdict


@dataclass(frozen=True)
class Entry:
    """A quarantined test: why, since when, and the runs that showed it."""

    unit: str
    nodeid: str
    reason: str  # "failed 1 of 3 on <commit>", or the fail rate in the window
    since_run: str
    since: float
    record: tuple[Evidence, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.unit, self.nodeid


@dataclass(frozen=True)
class QuarantineList:
    """The stored list: quarantined tests, and when each released test was last released."""

    entries: tuple[Entry, ...] = ()
    released: Mapping[str, float] = field(default_factory=dict)  # "<unit>::<nodeid>" → release time

    def entry(self, unit: str, nodeid: str) -> Entry | None:
        return next((e for e in self.entries if e.key == (unit, nodeid)), None)


def released_key(unit: str, nodeid: str) -> str:
    return f"{unit}::{nodeid}"


@dataclass(frozen=True)
class UnitDecision:
    """What one suite run changes in the list and what its report says."""

    quarantine: QuarantineList
    quarantined: tuple[Entry, ...]  # newly quarantined by this run
    released: tuple[tuple[Entry, int], ...]  # released by this run, with the passes that released it
    excused: tuple[Entry, ...]  # failed in this run while quarantined: they do not gate publishing
    gating: tuple[tuple[Entry, str], ...] = ()  # left quarantine by this run without passing: why they gate again
    ignored: tuple[str, ...] = ()  # stored outcomes and entries that did not check out, and why


def _flaky_commit(history: Sequence[tuple[RunOutcomes, Verdict]], policy: Quarantine) -> str:
    """The newest commit with both a pass and a fail among the last ``window`` runs (oldest first), or ""."""
    window = history[-policy.window:]
    for run, _ in reversed(window):
        seen = {v for r, v in window if run.commit and r.commit == run.commit}
        if seen == {"pass", "fail"}:
            return run.commit
    return ""


def _broken(history: Sequence[tuple[RunOutcomes, Verdict]], policy: Quarantine) -> str:
    """Why the test is broken, not flaky: its last ``broken_after`` commits each only failed; or ""."""
    commits: list[str] = []
    for run, _ in reversed(history):
        if run.commit and run.commit not in commits:
            commits.append(run.commit)
    newest = commits[:policy.broken_after]
    if len(newest) < policy.broken_after:
        return ""
    if any(v == "pass" for run, v in history if run.commit in newest):
        return ""
    shown = ", ".join(c[:12] for c in reversed(newest))
    return f"failed on {len(newest)} consecutive commits ({shown}): a real break, not a flake"


def _flaky_reason(history: Sequence[tuple[RunOutcomes, Verdict]], policy: Quarantine) -> str:
    """Why the test's outcomes (oldest first, the current run last) make it flaky, or ""."""
    commit = _flaky_commit(history, policy)
    if not commit or _broken(history, policy):
        return ""
    on_commit = [v for run, v in history[-policy.window:] if run.commit == commit]
    return f"failed {on_commit.count('fail')} of {len(on_commit)} on {commit[:12]}"


def _outcomes_of(unit: str, nodeid: str, runs: Sequence[RunOutcomes],
                 after: float) -> list[tuple[RunOutcomes, Verdict]]:
    return [(r, r.outcomes[nodeid]) for r in runs if r.unit == unit and nodeid in r.outcomes and r.created > after]


def _passes_since(entry: Entry, history: Sequence[tuple[RunOutcomes, Verdict]]) -> int:
    """Consecutive passes at the end of the runs after the one that quarantined ``entry``."""
    later = [v for run, v in history if run.created > entry.since and run.run_id != entry.since_run]
    count = 0
    for v in reversed(later):
        if v != "pass":
            break
        count += 1
    return count


def _still_quarantined(entry: Entry, history: Sequence[tuple[RunOutcomes, Verdict]],
                       policy: Quarantine) -> str:
    """Why ``entry`` must gate again although it did not pass its way out (broken, or expired), or ""."""
    broken = _broken(history, policy)
    if broken:
        return broken
    if not _flaky_commit(history, policy):
        return (f"no pass and fail on one commit in its last {policy.window} runs: its quarantine expired "
                f"(since run {entry.since_run})")
    return ""


def decide(quarantine: QuarantineList, runs: Sequence[RunOutcomes], current: RunOutcomes,
           policy: Quarantine) -> UnitDecision:
    """The list after ``current`` (one suite unit's run), judged with the stored ``runs`` before it (any order)."""
    ordered = sorted([r for r in runs if r.run_id != current.run_id] + [current], key=lambda r: r.created)
    entries = {e.key: e for e in quarantine.entries}
    released = dict(quarantine.released)
    new, freed, excused, gating = [], [], [], []
    for nodeid, outcome in current.outcomes.items():
        key = (current.unit, nodeid)
        entry = entries.get(key)
        history = _outcomes_of(current.unit, nodeid, ordered, released.get(released_key(*key), float("-inf")))
        if entry is None:
            reason = _flaky_reason(history, policy)
            if not reason:
                continue
            record = tuple(Evidence(r.run_id, r.commit, v) for r, v in history[-policy.window:])
            entry = Entry(current.unit, nodeid, reason, current.run_id, current.created, record)
            entries[key] = entry
            new.append(entry)
        else:
            passes = _passes_since(entry, _outcomes_of(current.unit, nodeid, ordered, entry.since))
            why = "" if passes >= policy.release_after else _still_quarantined(entry, history, policy)
            if passes >= policy.release_after or why:
                del entries[key]
                released[released_key(*key)] = current.created
                if why:
                    gating.append((entry, why))
                else:
                    freed.append((entry, passes))
                continue
        if outcome == "fail":
            excused.append(entry)
    kept = tuple(sorted(entries.values(), key=lambda e: e.key))
    return UnitDecision(replace(quarantine, entries=kept, released=released), tuple(new), tuple(freed),
                        tuple(excused), tuple(gating))


def excused_line(entry: Entry) -> str:
    """The summary's line for a quarantined test that failed in this run."""
    return f"quarantined: {entry.nodeid} ({entry.reason}) — did not gate publishing"


def quarantined_line(entry: Entry) -> str:
    runs = ", ".join(f"{e.run_id[:8]}@{e.commit[:12] or 'no commit'}: {e.verdict}" for e in entry.record)
    return f"flaky, now quarantined: {entry.nodeid} ({entry.reason}; runs {runs})"


def released_line(entry: Entry, passes: int) -> str:
    return f"released from quarantine: {entry.nodeid} ({passes} consecutive passes since run {entry.since_run})"


def gating_line(entry: Entry, why: str) -> str:
    return f"gates again: {entry.nodeid} left quarantine — {why}"


def to_json(quarantine: QuarantineList) -> dict[str, object]:
    return {"version": 1,
            "tests": [{"unit": e.unit, "nodeid": e.nodeid, "reason": e.reason, "since_run": e.since_run,
                       "since": e.since,
                       "record": [{"run_id": r.run_id, "commit": r.commit, "verdict": r.verdict} for r in e.record]}
                      for e in quarantine.entries],
            "released": dict(sorted(quarantine.released.items()))}


def from_json(data: Mapping[str, object]) -> QuarantineList:
    """The list from its stored JSON (:func:`to_json`); a malformed document raises KeyError/TypeError/ValueError."""
    tests = data.get("tests") or []
    released = data.get("released") or {}
    if not isinstance(tests, list) or not isinstance(released, dict):
        raise ValueError("'tests' must be a list and 'released' an object")
    entries = tuple(Entry(str(t["unit"]), str(t["nodeid"]), str(t["reason"]), str(t["since_run"]), float(t["since"]),
                          tuple(Evidence(str(r["run_id"]), str(r["commit"]), _verdict(r["verdict"]))
                                for r in t.get("record") or []))
                    for t in tests)
    return QuarantineList(entries, {str(k): float(v) for k, v in released.items()})


def _verdict(value: object) -> Verdict:
    if value == "pass" or value == "fail":
        return value
    raise ValueError(f"verdict {value!r} is neither 'pass' nor 'fail'")
