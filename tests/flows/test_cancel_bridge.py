"""The pieces of cancellation that need no flow: Prefect's names Kiln relies on, and the group registry."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kiln.flows.run import cancel
from kiln.tasks import process


@pytest.fixture
def fresh_cancel():
    process.reset_cancel()
    yield
    process.reset_cancel()


@pytest.mark.parametrize("dotted", cancel.PREFECT_NAMES)
def test_prefect_still_has_the_names_kiln_cancellation_relies_on(dotted):
    module, _, name = dotted.rpartition(".")
    assert hasattr(importlib.import_module(module), name), f"{dotted} is gone: see kiln.flows.run.cancel"


def test_importing_kiln_flows_makes_kiln_handler_prefects_sigterm_bridge():
    import prefect.utilities.engine as prefect_engine

    import kiln.flows.run.common  # noqa: F401 — arms the bridge on import

    assert prefect_engine._prefect_sigterm_handler is cancel._on_signal


def _sleeper() -> process.PopenChild:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    return process.PopenChild(proc)


def test_end_all_ends_every_registered_group(fresh_cancel):
    children = [_sleeper(), _sleeper()]
    for child in children:
        process.register(child, grace_s=1.0)
    ended = process.end_all()
    assert set(ended) == {c.pid for c in children}
    assert all(not process.group_alive(c.pid) for c in children)
    assert process.live_groups() == []


def test_a_group_registered_after_cancellation_is_ended_at_once(fresh_cancel):
    assert process.request_cancel("test")
    assert not process.request_cancel("again")  # only the first request counts
    child = _sleeper()
    with pytest.raises(process.RunCancelledError, match="being cancelled"):
        process.register(child, grace_s=1.0)
    assert not process.group_alive(child.pid)
    with pytest.raises(process.RunCancelledError, match="not started"):
        process.check_cancelled("a compile")
