"""The compile workers a command starts while Kiln's server starts: warmed, taken once by the build that asks for
them, and ended when nobody does. Real worker processes throughout (tasks/build/sparepool.py)."""

from __future__ import annotations

import pytest

from kiln.tasks.build import sparepool
from kiln.tasks.build.stage import compile_context, prepare_build
from kiln.tasks.build.units import build_unit
from tests.helpers.projects import copy_project
from tests.helpers.waiting import until

REGISTRY_LOADED = "'tinyk.registry' in __import__('sys').modules and 'triton.compiler' in __import__('sys').modules"


@pytest.fixture
def tiny(tmp_path):
    config = copy_project("tiny", tmp_path)
    yield str(config.resolve())
    sparepool.discard()


def test_the_build_takes_the_warmed_workers_and_starts_none_of_its_own(tiny, tmp_path):
    sparepool.prestart(tiny, 1, 120)
    setup = prepare_build(tiny, "0.1.0", ["cu130"], cache_dir=str(tmp_path / "cache"))
    with compile_context(setup, tmp_path / "out", jobs=1) as context:
        # The worker imported Triton's compiler and the registry before any unit asked it to.
        assert context.pool.call("builtins:eval", REGISTRY_LOADED, 120) is True
        pid = next(iter(context.pool._all)).process.pid
        unit = next(u for u in setup.plan.units if u.kind == "triton")
        build_unit(unit, context)
        assert [w.process.pid for w in context.pool._all] == [pid]  # the one warmed worker compiled it
    assert sparepool.take(tiny, 1) is None  # taken once


def test_a_pool_for_other_workers_is_ended_not_taken(tiny):
    sparepool.prestart(tiny, 1, 120)
    spare = sparepool._spare[0].compile_pool
    worker = until(lambda: list(spare.pool._all), bool, 120)[0]
    assert sparepool.take(tiny, 2) is None  # the build asks for two workers: this one is ended
    until(lambda: worker.process.poll(), lambda status: status is not None, 60)
    assert worker.process.poll() is not None


def test_a_pool_nobody_takes_ends_with_the_command(tiny):
    sparepool.prestart(tiny, 1, 120)
    spare = sparepool._spare[0].compile_pool
    worker = until(lambda: list(spare.pool._all), bool, 120)[0]
    sparepool.discard()  # what the command's exit runs (atexit)
    until(lambda: worker.process.poll(), lambda status: status is not None, 60)
    assert worker.process.poll() is not None and not sparepool._spare
