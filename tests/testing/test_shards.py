"""Sharding a suite: the partition by recorded durations, the shard units, the stored durations, the balance line."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest

from kiln.core.manifest import Unit
from kiln.core.store import open_store
from kiln.tasks.project.config import Suite
from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.jobs import Picked
from kiln.tasks.testing.shards import (
    ShardPicker,
    auto_count,
    balance_lines,
    compose,
    partition,
    read_durations,
    record_durations,
)

IDS = [f"t.py::test_{n:02d}" for n in range(12)]


def _loads(bins, durations):
    return [sum(durations[i] for i in b) for b in bins]


def test_every_test_lands_in_exactly_one_shard_in_collection_order():
    durations = {i: float(n % 5 + 1) for n, i in enumerate(IDS) if n % 3}  # some with history, some without
    bins = partition(IDS, durations, 3)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == sorted(IDS) and len(flat) == len(IDS)
    for b in bins:
        assert list(b) == sorted(b, key=IDS.index)  # each shard runs its tests in collection order


def test_longest_first_balances_recorded_durations():
    # Round-robin by collection order would put 8+6+1 against 7+2+1: LPT puts the longest first, each on the
    # lightest shard.
    durations = {"a": 8.0, "b": 7.0, "c": 6.0, "d": 2.0, "e": 1.0, "f": 1.0}
    bins = partition(list(durations), durations, 2)
    assert sorted(_loads(bins, durations)) == [12.0, 13.0]
    many = {f"t{n}": float(random.Random(n).randint(1, 100)) for n in range(200)}
    loads = _loads(partition(list(many), many, 4), many)
    assert max(loads) / (sum(loads) / 4) < 1.05  # LPT's bound with many small tests: close to perfect


def test_the_partition_is_the_same_whatever_order_the_durations_were_recorded_in():
    durations = {i: float(len(i) % 3 + 1) for i in IDS}  # many ties: the collection order breaks them
    shuffled = dict(sorted(durations.items(), key=lambda kv: random.Random(7).random()))
    assert partition(IDS, durations, 3) == partition(IDS, shuffled, 3)
    assert partition(IDS, durations, 3) == partition(list(IDS), dict(durations), 3)


def test_tests_without_history_are_dealt_evenly_by_collection_order():
    bins = partition(IDS, {}, 3)
    assert bins == [tuple(IDS[0::3]), tuple(IDS[1::3]), tuple(IDS[2::3])]


def test_the_deal_of_tests_without_history_starts_at_the_lighter_shard():
    durations = {IDS[0]: 10.0}
    bins = partition(IDS[:4], durations, 2)
    assert bins == [(IDS[0], IDS[2]), (IDS[1], IDS[3])]


def test_more_shards_than_tests_leaves_the_extra_shards_empty():
    bins = partition(IDS[:2], {IDS[0]: 1.0}, 4)
    assert sorted(len(b) for b in bins) == [0, 0, 1, 1]
    assert partition([], {}, 3) == [(), (), ()]


def test_zero_shards_is_refused():
    with pytest.raises(ValueError, match="0 shards"):
        partition(IDS, {}, 0)
    with pytest.raises(ValueError, match="shard 3 of 2"):
        ShardPicker(3, 2)


def test_the_shard_pickers_of_a_suite_cover_its_tests_once():
    durations = {i: float(n) for n, i in enumerate(IDS[:6])}
    picked = [ShardPicker(n, 3, durations)(IDS) for n in (1, 2, 3)]
    flat = [i for p in picked for i in p.run]
    assert sorted(flat) == sorted(IDS) and len(flat) == len(IDS)
    assert all(p.settled == () for p in picked)


def test_composed_with_selection_shards_what_selection_runs_and_shard_one_reports_the_carried():
    carried = TestResult(IDS[0], "passed", message="carried")

    def select(collected):
        return Picked(run=tuple(i for i in collected if i != IDS[0]), settled=(carried,))

    shards = [compose(select, ShardPicker(n, 2)) for n in (1, 2)]
    picked = [p(IDS) for p in shards if p is not None]
    assert sorted(i for p in picked for i in p.run) == sorted(IDS[1:])
    assert [p.settled for p in picked] == [(carried,), ()]
    assert compose(None, ShardPicker(1, 2)) == ShardPicker(1, 2) and compose(select, None) is select


@pytest.mark.parametrize(("total", "target", "bound", "count"), [
    (0.0, 600.0, 8, 1),       # no history: one shard
    (599.0, 600.0, 8, 1),
    (1300.0, 600.0, 8, 3),
    (10_000.0, 600.0, 4, 4),  # bounded by the units one machine runs at once
])
def test_auto_keeps_each_shard_under_its_target_within_the_bound(total, target, bound, count):
    durations = {"a": total / 2, "b": total / 2} if total else {}
    assert auto_count(durations, target, bound) == count


def test_suite_shards_accepts_a_count_or_auto_and_refuses_anything_else():
    assert Suite(name="s", paths=("t",), shards=3).shards == 3
    assert Suite(name="s", paths=("t",), shards="auto").shards == "auto"
    for bad in (0, -1, "many", 2.5, True):
        with pytest.raises(ValueError, match="shards"):
            Suite(name="s", paths=("t",), shards=bad)


def test_durations_merge_newest_wins_and_concurrent_shards_lose_nothing(tmp_path: Path):
    store = open_store(f"file://{tmp_path / 'store'}", root=tmp_path)
    record_durations(store, "test-history", "s.cpu", [TestResult("a", "passed", 1.0), TestResult("b", "failed", 2.0)])
    record_durations(store, "test-history", "s.cpu", [TestResult("a", "passed", 3.0),
                                                      TestResult("c", "skipped", 0.0)])  # a skip says nothing
    assert read_durations(store, "test-history", "s.cpu") == {"a": 3.0, "b": 2.0}

    def shard(n: int) -> int:
        return record_durations(store, "test-history", "par.cpu", [TestResult(f"t{n}-{k}", "passed", 0.5)
                                                                     for k in range(3)])

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(shard, range(4))) == [3] * 4
    assert len(read_durations(store, "test-history", "par.cpu")) == 12  # the compare-and-swap kept every write


def test_unreadable_durations_count_as_no_history(tmp_path: Path):
    store = open_store(f"file://{tmp_path / 'store'}", root=tmp_path)
    store.put_page("test-history/durations/s.cpu.json", b"{not json", "application/json", "no-cache", None)
    assert read_durations(store, "test-history", "s.cpu") == {}


def test_the_balance_line_shows_each_shards_wall_and_slowest_over_mean():
    units = [Unit(id=f"test/s/cpu/shard-{n}-of-2", stage="test", state="completed", duration_s=wall)
             for n, wall in ((2, 9.0), (1, 11.0))] + [Unit(id="test/t/cpu", stage="test", state="completed")]
    assert balance_lines(units) == ["test/s/cpu: 2 shards, walls 11.0s, 9.0s; balance 1.10 (slowest / mean)"]


def test_shard_units_and_reports_are_named_per_shard():
    from kiln.tasks.project.config import load_config
    from kiln.tasks.testing.suite import targets

    config = load_config(Path(__file__).resolve().parents[2] / "kiln.toml")
    suite = Suite(name="many", paths=("tests",), shards=2)
    auto = Suite(name="grow", paths=("tests",), shards="auto")
    made = targets(config, [suite, auto])
    variant = made[0].variant.name
    ids = [t.unit_id for t in made if t.variant.name == variant]
    assert ids == [f"test/many/{variant}/shard-1-of-2", f"test/many/{variant}/shard-2-of-2", f"test/grow/{variant}"]
    assert made[0].name == f"many.{variant}.shard-1-of-2" and made[0].suite_name == f"many.{variant}"
    grown = [t.unit_id for t in targets(config, [auto], {f"test/grow/{variant}": 3}) if t.variant.name == variant]
    assert grown == [f"test/grow/{variant}/shard-{n}-of-3" for n in (1, 2, 3)]
    assert all(a.shard < b.shard for a, b in pairwise(t for t in made if t.suite.name == "many"))
