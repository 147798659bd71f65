"""Tests carried by content: a test whose recorded inputs are unchanged and whose last run passed is not run again.

After each suite unit, Kiln's step process stores per test its outcome, duration, the keys of what it touched
(wheel members, its test file and conftests: :mod:`kiln.tasks.testing.touch`), their sha256 and the test
environment's lock (:mod:`kiln.tasks.testing.selection_store`). The next run of the unit decides per collected
test (:func:`decide`, pure): it is **carried** — reported ``passed``, naming the run it ran in — when it has a
record, its last outcome was a pass, it is not quarantined, its environment's lock and every touched key's
fingerprint are unchanged, and its bounds hold (it ran at most ``max_age_days`` ago and was carried at most
``max_carries`` times in a row); otherwise it **runs**, with the reason.

A test that recorded nothing of what it touched (recording is not possible for the package or suite: the tested
distribution is unknown in its environment) falls back to the suite level (:func:`fallback_keys`): its record
names every member of the wheel, its test file, the ``conftest.py`` files above it and the project's pytest
configuration, so it is carried only when none of those changed.

A full run (``--full``, a release) runs everything and is a recall check: a test that selection alone would
have carried and that fails is a miss (:func:`recall_misses`); it is reported loudly and turns selection off for
the suite until a person turns it back on (``kiln test --selection-on SUITE``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from kiln.core.errors import KilnError
from kiln.core.store import Store
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.project.config_build import Quarantine, Selection
from kiln.tasks.testing.classify import FAILING, TestResult
from kiln.tasks.testing.jobs import Picked, Picker
from kiln.tasks.testing.quarantine import read_quarantine
from kiln.tasks.testing.selection_store import Record, read_records, store_records, switch, switched_off
from kiln.tasks.testing.touch import ABSENT, TEST, environment_lock, fingerprint, wheel_key

_log = logging.getLogger(__name__)

Mode = Literal["select", "full", "release"]
_DAY_S = 86400.0


@dataclass(frozen=True)
class Choice:
    """Whether one collected test runs or is carried, and why."""

    nodeid: str
    carried: bool
    reason: str
    record: Record | None = None
    would_carry: bool = False  # inputs unchanged and last passed: what selection alone says, whatever the bounds


@dataclass(frozen=True)
class Plan:
    choices: tuple[Choice, ...]

    @property
    def carried(self) -> tuple[Choice, ...]:
        return tuple(c for c in self.choices if c.carried)

    def picked(self) -> Picked:
        """The runner's :class:`Picked`: the tests that run, and a carried pass for each of the others."""
        return Picked(run=tuple(c.nodeid for c in self.choices if not c.carried),
                      settled=tuple(carried_result(c.record) for c in self.choices if c.carried and c.record))


CARRIED = "carried from run "  # how a carried test's result (and its choice) begins: what the report shows


def carried_message(record: Record) -> str:
    return f"{CARRIED}{record.ran_run}: its inputs are unchanged"


def carried_result(record: Record) -> TestResult:
    """A carried test's result: passed, naming the run it ran in, and keeping the keys it touched then."""
    return TestResult(record.nodeid, "passed", message=carried_message(record), touched=record.touched)


def _some(keys: Sequence[str], shown: int = 3) -> str:
    return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def _why_not(record: Record | None, current: Mapping[str, str], env_lock: str, quarantined: frozenset[str],
             nodeid: str) -> str:
    """Why selection alone would run this test, or "" when its inputs and last outcome let it be carried."""
    if record is None:
        return "no record of an earlier run"
    if record.outcome != "passed":
        return f"its last outcome was {record.outcome} (only a pass is carried)"
    if nodeid in quarantined:
        return "it is quarantined"
    if not record.touched:
        return "no record of what it touched"
    if record.env_lock != env_lock:
        return "its environment changed"
    changed = [k for k in record.touched if current.get(k, ABSENT) != record.fingerprint.get(k)]
    return f"inputs changed: {_some(changed)}" if changed else ""


def _bound(record: Record, policy: Selection, now: float) -> str:
    """Why ``record``'s bounds force a run now, or ""."""
    age = now - record.ran_created
    if age > policy.max_age_days * _DAY_S:
        return (f"bound expired: it last ran {age / _DAY_S:.1f} days ago in run {record.ran_run} "
                f"(max_age_days = {policy.max_age_days:g})")
    if record.carries >= policy.max_carries:
        return (f"bound expired: carried {record.carries} runs in a row since run {record.ran_run} "
                f"(max_carries = {policy.max_carries})")
    return ""


def decide(collected: Sequence[str], records: Mapping[str, Record], current: Mapping[str, str], env_lock: str,
           policy: Selection, now: float, *, quarantined: Iterable[str] = (), off: str = "") -> Plan:
    """Run or carry each collected test. ``current``: the fingerprint now of every key the records name;
    ``off``: why this run carries nothing ("" when selection is on)."""
    held = frozenset(quarantined)
    choices = []
    for nodeid in collected:
        record = records.get(nodeid)
        why = _why_not(record, current, env_lock, held, nodeid)
        if why or record is None:
            choices.append(Choice(nodeid, False, why, record))
            continue
        forced = off or _bound(record, policy, now)
        choices.append(Choice(nodeid, not forced, forced or carried_message(record), record, would_carry=True))
    return Plan(tuple(choices))


def recall_misses(plan: Plan, results: Sequence[TestResult]) -> list[Choice]:
    """The tests selection alone would have carried that ran and failed: what it would have missed."""
    failed = {r.nodeid for r in results if r.outcome in FAILING}
    return [c for c in plan.choices if c.would_carry and not c.carried and c.nodeid in failed]


def recall_line(unit_id: str, misses: Sequence[Choice]) -> str:
    names = _some([c.nodeid for c in misses])
    return (f"SELECTION RECALL MISS in {unit_id}: {len(misses)} test(s) selection would have carried failed ({names}); "
            f"selection is now off for this suite — turn it back on with `kiln test --selection-on SUITE`")


def new_records(plan: Plan, results: Sequence[TestResult], fingerprint: Callable[[Sequence[str]], Mapping[str, str]],
                env_lock: str, run_created: float, run_id: str) -> list[Record]:
    """The records this run leaves: a carried test's earlier one, carried once more; a run test's, afresh."""
    carried = {c.nodeid: c.record for c in plan.carried if c.record is not None}
    out = []
    for result in results:
        before = carried.get(result.nodeid)
        if before is not None and result.outcome == "passed":
            out.append(replace(before, carries=before.carries + 1))
            continue
        touched = result.touched
        out.append(Record(result.nodeid, result.outcome, result.duration_s, touched,
                          dict(fingerprint(touched)) if touched else {}, env_lock, run_id, run_created))
    return out


# The files at the project root pytest may read its configuration from.
_PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def fallback_keys(nodeid: str, members: Iterable[str], root: Path) -> tuple[str, ...]:
    """The suite-level inputs of a test that recorded none: every member of the wheel (``members``: its archive
    names), the test's file, each ``conftest.py`` from ``root`` down to it and the pytest configuration files."""
    # a .data directory's files install outside the package tree (scripts, headers), as recording leaves them
    wheel = {key for name in members
             if not name.split("/", 1)[0].endswith(".data") and (key := wheel_key(name)) is not None}
    path = Path(nodeid.split("::", 1)[0])
    conftests = (Path(*path.parts[:n]) / "conftest.py" for n in range(len(path.parts)))
    files = {path, *conftests, *map(Path, _PYTEST_CONFIGS)}
    tests = {f"{TEST}{f.as_posix()}" for f in files if f == path or (root / f).is_file()}
    return tuple(sorted(wheel | tests))


def with_fallback(results: Sequence[TestResult], wheel: Path, root: Path) -> list[TestResult]:
    """``results``, each test that ran and recorded nothing given its :func:`fallback_keys`."""
    if all(r.touched for r in results if r.outcome != "skipped"):
        return list(results)
    from kiln.core.wheels import open_wheel

    with open_wheel(wheel.name, wheel) as archive:
        members = archive.namelist()
    return [replace(r, touched=fallback_keys(r.nodeid, members, root))
            if not r.touched and r.outcome != "skipped" and not r.nodeid.startswith("<") else r for r in results]


def _collection_failed(results: Sequence[TestResult]) -> bool:
    return any(r.nodeid == "<collection>" or r.message == "collection failed" for r in results)


# ---- one suite unit's selection, from its records to its report ---------------------------------------------

FULL_INFO = "test-selection-full"  # run info key: the run was started with --full (its dispatched suites read it)


def run_mode(flow: str, full: bool) -> Mode:
    """A release runs every test; so does a run started with ``--full``; anything else selects."""
    if flow == "release":
        return "release"
    return "full" if full else "select"


_OFF_REASON: dict[Mode, str] = {"select": "", "full": "--full: every test runs",
                                "release": "a release runs every test"}


@dataclass(frozen=True)
class Outcome:
    """What selection did for one suite unit: the counts and lines its unit and the summary show."""

    ran: int
    carried: int
    carried_from: tuple[str, ...]
    saved_s: float
    device: Literal["CPU", "GPU"]
    misses: tuple[Choice, ...] = ()
    lines: tuple[str, ...] = ()
    unrecorded: bool = False  # no test that ran recorded what it touched: nothing of the suite can be carried

    def summary(self, unit_id: str) -> list[str]:
        """The summary's lines for the unit: its counts, then what went wrong (a recall miss first)."""
        fallback = [f"{unit_id}: no test recorded what it touched (recording is not possible for this package or "
                    "suite): suite-level fallback, a test is carried only when no member of the wheel, none of its "
                    "test files and not its environment changed"] if self.unrecorded else []
        return [f"{unit_id}: {self.message()}", *fallback, *self.lines]

    def message(self) -> str:
        runs = ", ".join(r[:8] for r in self.carried_from)
        carried = f"{self.carried} carried" + (f" from run {runs}" if runs else "")
        return (f"selection: {self.ran} run, {carried}; {self.device}-seconds not spent: {self.saved_s:.1f}")


@dataclass
class Selector:
    """Selection for one suite unit (one shard of a sharded suite): :meth:`picker` before its tests run,
    :meth:`finish` after. ``folder``: the suite unit's history (every shard's); ``settles``: this unit reports
    the carried results (a sharded suite's first shard)."""

    store: Store
    history: Quarantine
    policy: Selection
    suite: str
    unit_id: str
    unit_name: str
    folder: str
    run_id: str
    created: float
    mode: Mode
    gpus: int
    quarantined: frozenset[str] = frozenset()
    settles: bool = True
    clock: Callable[[], float] = time.time
    plan: Plan | None = None
    env_lock: str = ""
    notes: tuple[str, ...] = ()
    _inputs: tuple[Path, Path] | None = None

    def off_reason(self) -> str:
        if not self.policy.enabled:
            return "selection is off ([testing.selection] enabled = false)"
        return _OFF_REASON[self.mode] or switched_off(self.store, self.history, self.suite)

    def records(self) -> dict[str, Record]:
        found, ignored = read_records(self.store, self.history, self.folder, self.run_id)
        self.notes += tuple(ignored)
        return found

    def picker(self, python: str | Path, wheel: Path, root: Path, tested: str, then: Picker | None = None) -> Picker:
        """The runner's picker for this unit, its records read now; a bookkeeping fault runs every test.
        ``then``: a shard's picker, which splits what selection runs."""
        self._inputs = (wheel, root)
        try:
            self.env_lock = environment_lock(python, tested)
            records, off = self.records(), self.off_reason()
        except KilnError as exc:
            _log.warning("test selection not applied to %s: %s", self.unit_id, exc)
            self.notes += (f"selection not applied: {exc}",)
            records, off = {}, f"selection not applied: {exc}"

        def pick(collected: Sequence[str]) -> Picked:
            keys = sorted({k for nodeid in collected if nodeid in records for k in records[nodeid].touched})
            try:
                current = fingerprint(keys, wheel, root) if keys else {}  # a full run too: its recall check
            except (KilnError, OSError) as exc:
                self.notes += (f"selection not applied: {exc}",)
                current = {}
            self.plan = decide(collected, records, current, self.env_lock, self.policy, self.clock(),
                               quarantined=self.quarantined, off=off)
            mine = self.plan.picked()
            shard = then(mine.run) if then is not None else Picked(mine.run)
            return Picked(shard.run, (mine.settled if self.settles else ()) + shard.settled)

        return pick

    def finish(self, results: Sequence[TestResult]) -> Outcome:
        """Store this unit's records, check recall where a test ran that selection would carry, and say what
        selection did."""
        plan = self.plan or Plan(())
        complete = self.plan is not None and not _collection_failed(results)
        lines = list(self.notes)
        if self._inputs is not None:
            wheel, root = self._inputs
            try:
                made = new_records(plan, with_fallback(results, wheel, root),
                                   lambda keys: fingerprint(keys, wheel, root), self.env_lock, self.created,
                                   self.run_id)
                store_records(self.store, self.history, folder=self.folder, unit_id=self.unit_id,
                              unit_name=self.unit_name, run_id=self.run_id, created=self.created, records=made,
                              complete=complete)
            except (KilnError, OSError) as exc:
                lines.append(f"selection records not stored: {exc}")
        if not complete:
            lines.append("collection failed: the next run carries nothing of this suite")
        misses = tuple(recall_misses(plan, results)) if self.policy.enabled else ()
        if misses:
            lines.insert(0, recall_line(self.unit_id, misses))
            try:
                switch(self.store, self.history, self.suite, lines[0])
            except KilnError as exc:
                lines.append(f"selection could not be switched off for suite {self.suite}: {exc}")
        reported = {r.nodeid for r in results}
        # what was reported as carried: a collection error makes the runner run what the picker would carry
        settled = {r.nodeid for r in results if r.message.startswith(CARRIED)}
        carried = [c for c in plan.carried if c.nodeid in settled and c.record is not None]
        ran = [r for r in results if r.nodeid not in {c.nodeid for c in carried} and r.outcome != "skipped"]
        return Outcome(len(reported) - len(carried), len(carried),
                       tuple(sorted({c.record.ran_run for c in carried if c.record})),
                       sum(c.record.duration_s for c in carried if c.record), "GPU" if self.gpus > 0 else "CPU",
                       misses, tuple(lines), unrecorded=bool(ran) and not any(r.touched for r in ran))


def explain(plan: Plan) -> list[str]:
    """``kiln test --explain``: one line per test, why it runs or is carried."""
    return [f"{'carry' if c.carried else 'run  '}  {c.nodeid}  — {c.reason}" for c in plan.choices]


def selector_for(config: KilnConfig, store: Store, *, suite: str, gpus: int, unit_id: str, unit_name: str,
                 folder: str, run_id: str, created: float, flow: str, full: bool, settles: bool = True) -> Selector:
    """The selector of one suite unit of run ``run_id``; the unit's quarantined tests are never carried (an
    unreadable quarantine list carries nothing). ``folder``, ``settles``: see :class:`Selector`."""
    history = config.testing.quarantine
    mode = run_mode(flow, full)
    try:
        base = unit_id.split("/shard-", 1)[0]  # a shard's tests are quarantined under any shard of its suite
        held = frozenset(e.nodeid for e in read_quarantine(store, history).entries
                         if e.unit == base or e.unit.startswith(f"{base}/"))
    except KilnError as exc:
        _log.warning("test selection off for %s: the quarantine list cannot be read (%s)", unit_id, exc)
        mode, held = "full", frozenset()
    return Selector(store, history, config.testing.selection, suite, unit_id, unit_name, folder, run_id, created,
                    mode, gpus, held, settles)


def explain_unit(selector: Selector, wheel: Path, root: Path) -> list[str]:
    """``kiln test --explain`` for one unit, without running anything: each test its newest record names, run
    or carried and why. The environment's lock is taken as recorded (it is checked when the suite runs: making
    the environment is not free), and a test added since has no record and runs."""
    records, off = selector.records(), selector.off_reason()
    keys = sorted({k for r in records.values() for k in r.touched})
    current = fingerprint(keys, wheel, root) if keys else {}
    locks = {r.env_lock for r in records.values()}
    lock = next(iter(locks)) if len(locks) == 1 else ""
    plan = decide(sorted(records), records, current, lock, selector.policy, selector.clock(),
                  quarantined=selector.quarantined, off=off)
    head = f"{selector.unit_id}: " + (f"{len(records)} tests recorded" if records else "no record: every test runs")
    return [head, *(f"  {line}" for line in explain(plan)), *(f"  {note}" for note in selector.notes)]
