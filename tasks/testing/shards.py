"""A suite split into shards: N units of its tests, balanced by the durations the test history holds.

A suite that says ``shards = N`` (or ``"auto"``) in ``kiln.toml`` runs as N units, ``test/<suite>/<variant>/
shard-<i>-of-<N>``, each an ordinary suite run (its own environment, collection, report and Prefect task run).
Each shard collects the whole suite and then keeps its part (a :class:`ShardPicker`, the runner's ``pick``):
the partition is a pure function of the collected ids, the durations and N, so every shard computes the same
one on its own, and every collected test is run by exactly one shard.

Durations live in one small object per suite and variant in the artifact store,
``<[testing.quarantine] history>/durations/<suite>.<variant>.json`` (node id → seconds of its most recent run),
merged by every shard after it ran (compare-and-swap). A store object of its own rather than a field of the
quarantine's per-run outcomes: reading it is one GET (not every stored run of every shard unit), it is written
whether or not quarantine is enabled, and it leaves the outcomes format alone. It is not checked against run
records as outcomes are: a duration only shapes the partition, and any partition runs every test once, so a
forged one can unbalance the shards, never skip a test.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError
from kiln.core.manifest import Unit
from kiln.core.objects import Store
from kiln.core.swap import until_swapped
from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.jobs import Picked, Picker

if TYPE_CHECKING:  # the summary reads balance_lines without importing what a suite run needs
    from kiln.tasks.testing.suite import SuiteRun, SuiteTarget

logger = logging.getLogger(__name__)

SHARD_ID = "/shard-"  # a shard unit's id: its suite unit's id + "/shard-<i>-of-<N>"
SHARDS_INFO = "shards:"  # run info key prefix (+ the suite unit's id): how many shards "auto" chose in this run
# run info key prefix (+ the suite unit's id): the durations a dispatched suite's shards are split by, pinned
# by its dispatcher before any shard starts (each shard is its own flow run, on whichever worker takes it)
DURATIONS_INFO = "shard-durations:"
CONTENT_TYPE = "application/json"


def partition(ids: Sequence[str], durations: Mapping[str, float], count: int) -> list[tuple[str, ...]]:
    """``ids`` split into ``count`` bins, each in collection order.

    Tests with a recorded duration go longest first onto the least loaded bin (LPT; ties: the earlier test, the
    lower bin); then the tests without one are dealt round-robin by collection order, starting with the least
    loaded bin, so they spread evenly. Deterministic given (ids, durations, count).
    """
    if count < 1:
        raise ValueError(f"a suite cannot be split into {count} shards")
    order = {nodeid: n for n, nodeid in enumerate(ids)}
    loads = [0.0] * count
    bins: list[list[str]] = [[] for _ in range(count)]
    known = sorted((i for i in order if i in durations), key=lambda i: (-max(durations[i], 0.0), order[i]))
    for nodeid in known:
        lightest = min(range(count), key=lambda b: (loads[b], b))
        bins[lightest].append(nodeid)
        loads[lightest] += max(durations[nodeid], 0.0)
    by_load = sorted(range(count), key=lambda b: (loads[b], b))
    for n, nodeid in enumerate(i for i in order if i not in durations):
        bins[by_load[n % count]].append(nodeid)
    return [tuple(sorted(b, key=order.__getitem__)) for b in bins]


@dataclass(frozen=True)
class ShardPicker:
    """The runner's ``pick`` for shard ``index`` (1-based) of ``count``: its part of the collected tests."""

    index: int
    count: int
    durations: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.index <= self.count:
            raise ValueError(f"shard {self.index} of {self.count} does not exist")

    def __call__(self, collected: Sequence[str]) -> Picked:
        return Picked(run=partition(collected, self.durations, self.count)[self.index - 1])


@dataclass(frozen=True)
class Composed:
    """``first`` (test selection) decides what runs and what it reports without running; ``then`` (a shard)
    splits what runs. The settled results cost no test time and belong to one unit: shard 1 reports them."""

    first: Picker
    then: Picker

    def __call__(self, collected: Sequence[str]) -> Picked:
        chosen = self.first(collected)
        mine = self.then(chosen.run)
        owner = not isinstance(self.then, ShardPicker) or self.then.index == 1
        return Picked(run=mine.run, settled=(chosen.settled if owner else ()) + mine.settled)


def compose(first: Picker | None, then: Picker | None) -> Picker | None:
    """``first`` (selection), then ``then`` (a shard) over what ``first`` runs; either may be absent."""
    if first is None or then is None:
        return then if first is None else first
    return Composed(first, then)


def auto_count(durations: Mapping[str, float], target_s: float, bound: int) -> int:
    """Enough shards that each holds about ``target_s`` of recorded duration, between 1 and ``bound``."""
    total = sum(max(d, 0.0) for d in durations.values())
    return max(1, min(bound, math.ceil(total / target_s)))


def durations_key(prefix: str, suite_name: str) -> str:
    """Where the durations of ``suite_name`` (``<suite>.<variant>``, no shard) live in the store."""
    return f"{prefix.strip('/')}/durations/{suite_name}.json"


def _parse(data: bytes, where: str) -> dict[str, float]:
    try:
        doc = json.loads(data)
        return {str(k): float(v) for k, v in doc["durations"].items() if float(v) >= 0}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring unreadable test durations %s: %s", where, exc)
        return {}


def read_durations(store: Store, prefix: str, suite_name: str) -> dict[str, float]:
    """The recorded durations of ``suite_name``'s tests; none when nothing (readable) is stored."""
    key = durations_key(prefix, suite_name)
    data = store.get(key)
    return {} if data is None else _parse(data, f"{store.url}/{key}")


def ran(results: Iterable[TestResult]) -> dict[str, float]:
    """The duration of each test that ran: a skipped test, or one reported without running, says nothing."""
    return {r.nodeid: r.duration_s for r in results if r.outcome != "skipped" and r.duration_s > 0}


def record_durations(store: Store, prefix: str, suite_name: str, results: Iterable[TestResult]) -> int:
    """Merge the durations of the tests that ran into ``suite_name``'s stored ones (each test's newest wins);
    how many were recorded. Shards of one suite merge concurrently: compare-and-swap, bounded retries."""
    fresh = ran(results)
    if not fresh:
        return 0
    key = durations_key(prefix, suite_name)

    def attempt() -> int:
        page = store.get_page(key)
        known = {} if page is None else _parse(page[0], f"{store.url}/{key}")
        doc = {"durations": dict(sorted({**known, **fresh}.items()))}
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        store.put_page(key, data, CONTENT_TYPE, "no-cache", None if page is None else page[1])
        return len(fresh)

    return until_swapped(f"{store.url}/{key}", attempt)


def record_quietly(store: Store, prefix: str, suite_name: str, results: Iterable[TestResult]) -> None:
    """:func:`record_durations`, where a store fault costs only the next partition's balance: logged, not
    raised (a suite's outcome never depends on its bookkeeping)."""
    try:
        record_durations(store, prefix, suite_name, results)
    except KilnError as exc:
        logger.warning("test durations of %s not recorded: %s", suite_name, exc)


@dataclass(frozen=True)
class ShardPlan:
    """A run's shards, decided once before any shard starts: the durations each sharded suite unit is split by
    and the count each ``"auto"`` one chose, both by the suite unit's id. Every shard gets the same snapshot, so
    a shard finishing (and recording durations) never changes another's partition."""

    durations: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)

    def picker(self, target: SuiteTarget) -> ShardPicker | None:
        if not target.shard:
            return None
        return ShardPicker(target.shard, target.shards, self.durations.get(target.suite_unit_id, {}))


def plan(store: Store, prefix: str, whole: Iterable[SuiteTarget], bound: int) -> ShardPlan:
    """The durations of every sharded suite unit in ``whole`` (unsharded targets) and the count of each
    ``"auto"`` one: enough for ``shard_target_s`` each, at most ``bound`` (the units one machine runs at once)."""
    durations: dict[str, Mapping[str, float]] = {}
    counts: dict[str, int] = {}
    for target in whole:
        if target.suite.shards == 1:
            continue
        known = read_durations(store, prefix, target.suite_name)
        durations[target.suite_unit_id] = known
        if target.suite.shards == "auto":
            counts[target.suite_unit_id] = auto_count(known, target.suite.shard_target_s, bound)
            logger.info("suite %s: %d shard(s) for %.0f s of recorded durations (target %g s, at most %d)",
                        target.suite_name, counts[target.suite_unit_id], sum(known.values()),
                        target.suite.shard_target_s, bound)
    return ShardPlan(durations, counts)


def pinned(info: Mapping[str, Any]) -> ShardPlan:
    """The plan a dispatcher pinned in a run's info (:data:`SHARDS_INFO`, :data:`DURATIONS_INFO`): what every
    separately dispatched shard of a suite partitions by, whatever durations its siblings recorded since."""
    durations = {key[len(DURATIONS_INFO):]: {str(k): float(v) for k, v in value.items()}
                 for key, value in info.items() if key.startswith(DURATIONS_INFO) and isinstance(value, dict)}
    return ShardPlan(durations, recorded_counts(info))


def pin_entries(plan: ShardPlan) -> dict[str, Any]:
    """The run info entries that pin ``plan`` for shards dispatched apart (read back by :func:`pinned`)."""
    return {**{f"{SHARDS_INFO}{unit_id}": count for unit_id, count in plan.counts.items()},
            **{f"{DURATIONS_INFO}{unit_id}": dict(known) for unit_id, known in plan.durations.items()}}


def record_runs(store: Store, prefix: str, runs: Iterable[tuple[SuiteTarget, SuiteRun]]) -> None:
    """Record the durations of every suite run, one merge per suite unit (its shards together)."""
    merged: dict[str, list[TestResult]] = {}
    for target, run in runs:
        merged.setdefault(target.suite_name, []).extend(run.results)
    for suite_name, results in merged.items():
        record_quietly(store, prefix, suite_name, results)


def recorded_counts(info: Mapping[str, Any]) -> dict[str, int]:
    """The shard counts "auto" chose in a run, by suite unit id, from its info entries."""
    return {key[len(SHARDS_INFO):]: int(value) for key, value in info.items()
            if key.startswith(SHARDS_INFO) and isinstance(value, int) and value >= 1}


def balance_lines(units: Iterable[Unit]) -> list[str]:
    """One line per sharded suite unit: each shard's wall and the balance (slowest / mean)."""
    groups: dict[str, list[Unit]] = {}
    for unit in units:
        if unit.stage == "test" and SHARD_ID in unit.id:
            groups.setdefault(unit.id.rsplit(SHARD_ID, 1)[0], []).append(unit)
    lines = []
    for suite_unit, shards in sorted(groups.items()):
        shards.sort(key=lambda u: _shard_index(u.id))
        walls = [u.duration_s for u in shards]
        mean = sum(walls) / len(walls)
        balance = f"{max(walls) / mean:.2f}" if mean > 0 else "n/a"
        lines.append(f"{suite_unit}: {len(shards)} shards, walls "
                     f"{', '.join(f'{w:.1f}s' for w in walls)}; balance {balance} (slowest / mean)")
    return lines


def _shard_index(unit_id: str) -> int:
    head = unit_id.rsplit(SHARD_ID, 1)[1].split("-of-", 1)[0]
    return int(head) if head.isdigit() else 0
