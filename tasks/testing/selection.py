"""Tests carried by content: a test whose recorded inputs are unchanged and whose last run passed is not run again.

After each suite unit Kiln's step process stores, per test, its outcome, duration, the keys of what it touched
(wheel members, its test file and conftests: :mod:`kiln.tasks.testing.touch`), their sha256 and the test
environment's lock, create-only under ``<history>/selection/<unit>/<stamp>-<run id>.json`` and a second time in
the run's own record (info ``test-selection:<unit id>``): a stored record counts only when the run it names
recorded the same document. The next run of the unit reads the newest record and decides, per collected test
(:func:`decide`, pure): it is **carried** — reported ``passed``, naming the run it ran in — when it has a record,
its last outcome was a pass, it is not quarantined, its environment's lock and every touched key's fingerprint
are unchanged, and its bounds hold (it ran at most ``max_age_days`` ago and was carried at most ``max_carries``
times in a row); otherwise it **runs**, with the reason.

A full run (``--full``, a release, selection switched off) runs everything and is a recall check: a test that
selection alone would have carried and that fails is a miss (:func:`recall_misses`); it is reported loudly and
turns selection off for the suite (``<history>/selection/off/<suite>.json``) until a person turns it back on.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import subprocess
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from kiln.core.errors import InvalidInputError, KilnError
from kiln.core.record import info_json, info_key, load_info
from kiln.core.store import Store
from kiln.core.swap import until_swapped
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.project.config_build import Quarantine, Selection
from kiln.tasks.testing.classify import FAILING, TestResult
from kiln.tasks.testing.jobs import Picked
from kiln.tasks.testing.quarantine import read_quarantine

_log = logging.getLogger(__name__)

Mode = Literal["select", "full", "release"]
MODES: tuple[Mode, ...] = ("select", "full", "release")
CONTENT_TYPE = "application/json"
IMMUTABLE = "public, max-age=31536000, immutable"
SELECTION_INFO = "test-selection:"  # run info key prefix (+ unit id): the unit's records as the step stored them
ABSENT = "absent"
LOCK_TIMEOUT_S = 60.0
_DAY_S = 86400.0


@dataclass(frozen=True)
class Record:
    """One test's last word in one unit's history: what it did and what it depended on."""

    nodeid: str
    outcome: str
    duration_s: float
    touched: tuple[str, ...]
    fingerprint: Mapping[str, str]  # touched key -> sha256 when it last ran, or "absent"
    env_lock: str
    ran_run: str        # the run the test last actually ran in: the run a carried result names
    ran_created: float  # that run's start, Unix seconds
    carries: int = 0    # runs in a row it was carried since it ran


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


def with_touched(result: TestResult, touched: Sequence[str]) -> TestResult:
    """``result`` holding ``touched`` (the keys a carried test keeps, so the next run can carry it again)."""
    if any(f.name == "touched" for f in fields(TestResult)):
        extra: dict[str, Any] = {"touched": tuple(touched)}
        return replace(result, **extra)
    return result


def touched_of(result: TestResult) -> tuple[str, ...]:
    return tuple(getattr(result, "touched", ()) or ())


def carried_result(record: Record) -> TestResult:
    return with_touched(TestResult(record.nodeid, "passed",
                                   message=f"carried from run {record.ran_run}: its inputs are unchanged"),
                        record.touched)


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
        choices.append(Choice(nodeid, not forced, forced or f"carried from run {record.ran_run}: its inputs are "
                              "unchanged", record, would_carry=True))
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
        touched = touched_of(result)
        out.append(Record(result.nodeid, result.outcome, result.duration_s, touched,
                          dict(fingerprint(touched)) if touched else {}, env_lock, run_id, run_created))
    return out


def _collection_failed(results: Sequence[TestResult]) -> bool:
    return any(r.nodeid == "<collection>" or r.message == "collection failed" for r in results)


# ---- the stored history ------------------------------------------------------------------------------------

def _prefix(history: Quarantine) -> str:
    return f"{history.history.strip('/')}/selection"


def records_key(history: Quarantine, unit_name: str, run_id: str, created: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(created))
    return f"{_prefix(history)}/runs/{unit_name}/{stamp}-{run_id}.json"


def _doc(unit_id: str, run_id: str, created: float, complete: bool, records: Sequence[Record]) -> dict[str, Any]:
    return {"version": 1, "unit": unit_id, "run_id": run_id, "created": created, "complete": complete,
            "tests": [{"nodeid": r.nodeid, "outcome": r.outcome, "duration_s": r.duration_s,
                       "touched": list(r.touched), "fingerprint": dict(sorted(r.fingerprint.items())),
                       "env_lock": r.env_lock, "ran_run": r.ran_run, "ran_created": r.ran_created,
                       "carries": r.carries} for r in records]}


def _parse(doc: Any) -> dict[str, Record]:
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), list):
        raise ValueError("not a selection record (no 'tests' list)")
    if not doc.get("complete"):
        return {}  # its suite failed to collect: nothing it stored may be carried
    found = {}
    for t in doc["tests"]:
        fingerprint = t["fingerprint"]
        if not isinstance(fingerprint, dict):
            raise ValueError("'fingerprint' must be an object")
        record = Record(str(t["nodeid"]), str(t["outcome"]), float(t["duration_s"]), tuple(map(str, t["touched"])),
                        {str(k): str(v) for k, v in fingerprint.items()}, str(t["env_lock"]), str(t["ran_run"]),
                        float(t["ran_created"]), int(t["carries"]))
        found[record.nodeid] = record
    return found


def store_records(store: Store, history: Quarantine, unit_id: str, unit_name: str, run_id: str, created: float,
                  records: Sequence[Record], complete: bool) -> str:
    """Store this run's records create-only, in the history and in the run's own record."""
    doc = _doc(unit_id, run_id, created, complete, records)
    info = f"{SELECTION_INFO}{unit_id}"
    store.put_immutable(info_key(run_id, info), info_json(info, doc), CONTENT_TYPE, "no-cache")
    key = records_key(history, unit_name, run_id, created)
    store.put_immutable(key, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), CONTENT_TYPE, IMMUTABLE)
    _log.info("stored the selection records of %d tests as %s/%s", len(records), store.url, key)
    return key


def read_records(store: Store, history: Quarantine, unit_id: str, unit_name: str,
                 tries: int = 3) -> tuple[dict[str, Record], str]:
    """The newest stored records of the unit that its run's own record backs, and a line for each one ignored."""
    ignored = []
    for key in reversed(store.list(f"{_prefix(history)}/runs/{unit_name}/")[-tries:]):
        try:
            data = store.get(key)
            doc = json.loads(data or b"null")
            run_id = str(doc["run_id"]) if isinstance(doc, dict) else ""
            backed = load_info(store, run_id, f"{SELECTION_INFO}{unit_id}") if run_id else None
            if backed != doc:
                ignored.append(f"ignored selection record {key}: run {run_id or '?'} did not record it")
                continue
            return _parse(doc), "; ".join(ignored)
        except (ValueError, KeyError, TypeError, KilnError) as exc:
            ignored.append(f"ignored selection record {key}: {exc}")
    return {}, "; ".join(ignored)


def off_key(history: Quarantine, suite: str) -> str:
    return f"{_prefix(history)}/off/{suite}.json"


def switched_off(store: Store, history: Quarantine, suite: str) -> str:
    """Why a recall miss switched selection off for ``suite``, or "" when it is on."""
    page = store.get_page(off_key(history, suite))
    if page is None:
        return ""
    try:
        doc = json.loads(page[0])
    except ValueError:
        return f"selection is off for suite {suite} (its switch {off_key(history, suite)} is unreadable)"
    return str(doc.get("why") or "") if isinstance(doc, dict) and doc.get("off") else ""


def switch(store: Store, history: Quarantine, suite: str, why: str) -> None:
    """Turn selection off for ``suite`` (``why`` says which miss), or back on (``why`` empty)."""
    key = off_key(history, suite)
    data = (json.dumps({"off": bool(why), "why": why, "at": time.time()}, indent=1) + "\n").encode()

    def attempt() -> None:
        page = store.get_page(key)
        store.put_page(key, data, CONTENT_TYPE, "no-cache", None if page is None else page[1])

    until_swapped(f"{store.url}/{key}", attempt)


# ---- fingerprints and the environment's lock ---------------------------------------------------------------

def _touch() -> Any:
    try:
        return importlib.import_module("kiln.tasks.testing.touch")
    except ImportError:
        return None


def fingerprint(keys: Iterable[str], wheel: Path, root: Path) -> dict[str, str]:
    """Each key's sha256 now (``wheel:<member>``, ``test:<path under root>``), or "absent"."""
    touch = _touch()
    if touch is not None:
        return dict(touch.fingerprint(keys, wheel, root))
    return _fingerprint_fallback(keys, wheel, root)


def _fingerprint_fallback(keys: Iterable[str], wheel: Path, root: Path) -> dict[str, str]:
    """The recording module's contract, for a checkout without it: METADATA without its Version line (the run
    stamps its version there), ``{dist-info}`` standing for the wheel's dist-info folder."""
    out: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next((n.split("/", 1)[0] for n in sorted(names) if n.split("/", 1)[0].endswith(".dist-info")), "")
        for key in keys:
            kind, _, name = key.partition(":")
            if kind == "wheel":
                member = name.replace("{dist-info}", dist_info, 1)
                if member not in names:
                    out[key] = ABSENT
                    continue
                data = archive.read(member)
                if member == f"{dist_info}/METADATA":
                    data = b"".join(ln for ln in data.splitlines(keepends=True) if not ln.startswith(b"Version:"))
                out[key] = hashlib.sha256(data).hexdigest()
            elif kind == "test":
                path = (root / name).resolve()
                inside = path.is_relative_to(root.resolve()) and path.is_file()
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest() if inside else ABSENT
            else:
                raise InvalidInputError(f"touched key {key!r}: expected wheel:<member> or test:<path>")
    return out


def environment_lock(python: str | Path, tested: str) -> str:
    """sha256 of the environment's ``name==version`` list without the tested distribution."""
    touch = _touch()
    if touch is not None:
        return str(touch.environment_lock(python, tested))
    script = ("import importlib.metadata as m\n"
              "print('\\n'.join(sorted(f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions())))")
    try:
        done = subprocess.run([str(python), "-I", "-c", script], capture_output=True, text=True, check=True,
                              timeout=LOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise InvalidInputError(f"cannot list the test environment of {python}: {exc}") from exc
    skip = tested.lower().replace("_", "-")
    kept = [ln for ln in done.stdout.splitlines() if ln.partition("==")[0].lower().replace("_", "-") != skip]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


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

    def summary(self, unit_id: str) -> list[str]:
        """The summary's lines for the unit: its counts, then what went wrong (a recall miss first)."""
        return [f"{unit_id}: {self.message()}", *self.lines]

    def message(self) -> str:
        runs = ", ".join(r[:8] for r in self.carried_from)
        carried = f"{self.carried} carried" + (f" from run {runs}" if runs else "")
        return (f"selection: {self.ran} run, {carried}; {self.device}-seconds not spent: {self.saved_s:.1f}")


@dataclass
class Selector:
    """Selection for one suite unit: :meth:`picker` before its tests run, :meth:`finish` after."""

    store: Store
    history: Quarantine
    policy: Selection
    suite: str
    unit_id: str
    unit_name: str
    run_id: str
    created: float
    mode: Mode
    gpus: int
    quarantined: frozenset[str] = frozenset()
    clock: Callable[[], float] = time.time
    plan: Plan | None = None
    env_lock: str = ""
    notes: tuple[str, ...] = ()
    _wheel: Path | None = None
    _root: Path | None = None

    def off_reason(self) -> str:
        if not self.policy.enabled:
            return "selection is off ([testing.selection] enabled = false)"
        return _OFF_REASON[self.mode] or switched_off(self.store, self.history, self.suite)

    def picker(self, python: str | Path, wheel: Path, root: Path, tested: str,
               within: Callable[[Sequence[str]], Picked] | None = None) -> Callable[[Sequence[str]], Picked]:
        """The runner's picker for this unit, its records read now; a bookkeeping fault runs every test.
        ``within``: a picker that first takes this unit's share of the collected tests (a shard's)."""
        self._wheel, self._root = wheel, root
        try:
            self.env_lock = environment_lock(python, tested)
            records, ignored = read_records(self.store, self.history, self.unit_id, self.unit_name)
            off = self.off_reason()
        except (KilnError, OSError) as exc:
            _log.warning("test selection not applied to %s: %s", self.unit_id, exc)
            self.notes = (f"selection not applied: {exc}",)
            records, ignored, off = {}, "", f"selection not applied: {exc}"
        self.notes += (ignored,) if ignored else ()

        def pick(everything: Sequence[str]) -> Picked:
            share = within(everything) if within is not None else Picked(tuple(everything))
            collected = share.run
            keys = sorted({k for nodeid in collected if nodeid in records for k in records[nodeid].touched})
            try:
                current = fingerprint(keys, wheel, root) if keys else {}  # a full run too: its recall check
            except (KilnError, OSError, zipfile.BadZipFile) as exc:
                self.notes += (f"selection not applied: {exc}",)
                current = {}
            self.plan = decide(collected, records, current, self.env_lock, self.policy, self.clock(),
                               quarantined=self.quarantined, off=off)
            mine = self.plan.picked()
            return Picked(mine.run, (*share.settled, *mine.settled))

        return pick

    def finish(self, results: Sequence[TestResult]) -> Outcome:
        """Store this run's records, check recall on a run that ran what selection would carry, and say what
        selection did."""
        plan = self.plan or Plan(())
        complete = not _collection_failed(results)
        lines = list(self.notes)
        if self._wheel is not None and self._root is not None:
            wheel, root = self._wheel, self._root
            made = new_records(plan, results, lambda keys: fingerprint(keys, wheel, root), self.env_lock,
                               self.created, self.run_id)
            try:
                store_records(self.store, self.history, self.unit_id, self.unit_name, self.run_id, self.created,
                              made, complete)
            except (KilnError, OSError) as exc:
                lines.append(f"selection records not stored: {exc}")
        if not complete:
            lines.append("collection failed: the next run carries nothing of this suite")
        misses = tuple(recall_misses(plan, results)) if self.policy.enabled else ()
        if misses:
            why = recall_line(self.unit_id, misses)
            lines.insert(0, why)
            try:
                switch(self.store, self.history, self.suite, why)
            except KilnError as exc:
                lines.append(f"selection could not be switched off for suite {self.suite}: {exc}")
        carried = plan.carried
        ran = sum(1 for r in results if r.nodeid not in {c.nodeid for c in carried})
        return Outcome(ran, len(carried), tuple(sorted({c.record.ran_run for c in carried if c.record})),
                       sum(c.record.duration_s for c in carried if c.record), "GPU" if self.gpus > 0 else "CPU",
                       misses, tuple(lines))


def explain(plan: Plan) -> list[str]:
    """``kiln test --explain``: one line per test, why it runs or is carried."""
    return [f"{'carry' if c.carried else 'run  '}  {c.nodeid}  — {c.reason}" for c in plan.choices]


def selector_for(config: KilnConfig, store: Store, *, suite: str, gpus: int, unit_id: str, unit_name: str,
                 run_id: str, created: float, flow: str, full: bool) -> Selector:
    """The selector of one suite unit of run ``run_id``; the unit's quarantined tests are never carried (an
    unreadable quarantine list carries nothing)."""
    history = config.testing.quarantine
    mode = run_mode(flow, full)
    try:
        held = frozenset(e.nodeid for e in read_quarantine(store, history).entries if e.unit == unit_id)
    except KilnError as exc:
        _log.warning("test selection off for %s: the quarantine list cannot be read (%s)", unit_id, exc)
        mode, held = "full", frozenset()
    return Selector(store, history, config.testing.selection, suite, unit_id, unit_name, run_id, created, mode, gpus,
                    held)


def explain_unit(selector: Selector, wheel: Path, root: Path) -> list[str]:
    """``kiln test --explain`` for one unit, without running anything: each test its newest record names, run
    or carried and why. The environment's lock is taken as recorded (it is checked when the suite runs: making
    the environment is not free), and a test added since has no record and runs."""
    records, ignored = read_records(selector.store, selector.history, selector.unit_id, selector.unit_name)
    off = selector.off_reason()
    keys = sorted({k for r in records.values() for k in r.touched})
    current = fingerprint(keys, wheel, root) if keys else {}
    locks = {r.env_lock for r in records.values()}
    lock = next(iter(locks)) if len(locks) == 1 else ""
    plan = decide(sorted(records), records, current, lock, selector.policy, selector.clock(),
                  quarantined=selector.quarantined, off=off)
    head = f"{selector.unit_id}: " + (f"{len(records)} tests recorded" if records else "no record: every test runs")
    return [head, *(f"  {line}" for line in explain(plan)), *([f"  {ignored}"] if ignored else [])]
