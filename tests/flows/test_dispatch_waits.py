"""No silent waits: a dispatched unit says what it waits for, and stops (cancelled) with its dispatcher."""

from __future__ import annotations

import datetime
import logging
import re
import time
import uuid
from types import SimpleNamespace

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import WorkerStatus

from kiln.flows.run import dispatch as dispatching
from kiln.flows.run.waiting import Waiting, cancel_dispatched_on_exit, time_left, worker_is_live
from tests.flows.test_dispatch import config_with_pool, deploy_gpu_tests
from tests.helpers.waiting import until

NOW = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize("status, beat_s_ago, interval_s, live", [
    (WorkerStatus.ONLINE, 10, 30, True),
    (WorkerStatus.ONLINE, 89, 30, True),      # three intervals: Prefect's foreman would not mark it offline yet
    (WorkerStatus.ONLINE, 91, 30, False),     # a server without a foreman still says ONLINE: the heartbeat decides
    (WorkerStatus.ONLINE, 50, None, True),    # no interval sent: Prefect's fallback of 30 s
    (WorkerStatus.ONLINE, None, 30, False),   # never sent a heartbeat
    (WorkerStatus.OFFLINE, 1, 30, False),
])
def test_a_worker_is_live_while_its_heartbeats_are_recent(status, beat_s_ago, interval_s, live):
    beat = None if beat_s_ago is None else NOW - datetime.timedelta(seconds=beat_s_ago)
    worker = SimpleNamespace(status=status, last_heartbeat_time=beat, heartbeat_interval_seconds=interval_s)
    assert worker_is_live(worker, NOW) is live


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (45.4, "45 s"), (185, "3 min 5 s"), (3600, "1 h 0 min"),
                                           (-3, "0 s")])
def test_time_left_reads_as_a_person_would_say_it(seconds, text):
    assert time_left(seconds) == text


def _record(tmp_path):
    from kiln.core.record import RunHeader, create_record
    from kiln.core.store import LocalStore

    return create_record(LocalStore(tmp_path / "a"), RunHeader(run_id=uuid.uuid4().hex, flow="nightly",
                                                               version="0.1.0.dev1"), tmp_path / "o")


@pytest.fixture
def run_log():
    """Every line the run's loggers (Prefect's, Kiln's) pass on at INFO: what a person watching the run reads."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, loggers = Keep(logging.INFO), [logging.getLogger("prefect"), logging.getLogger("kiln")]
    for each in loggers:
        each.addHandler(handler)
    yield lines
    for each in loggers:
        each.removeHandler(handler)


def _waiting(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("waiting for")]


def _dispatch_in_a_flow(pool: str, tmp_path, deadline_s: float, waiting: Waiting, name: str | None = None) -> str:
    @flow
    def parent() -> str:
        return dispatching.dispatch(f"test/{pool}", {"suites": ["kernels-gpu"]}, deadline_s=deadline_s,
                                    what="testing kernels-gpu", commit="", run=_record(tmp_path), name=name,
                                    waiting=waiting)

    return parent()


def test_a_dispatch_waiting_for_a_worker_says_so_every_interval_naming_the_pool_and_the_time_left(
        prefect_server, tmp_path, run_log):
    pool = f"wait-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    short = Waiting(poll_s=0.05, log_every_s=0.5)  # a minute in production
    why = _dispatch_in_a_flow(pool, tmp_path, 3, short, name="test kernels-gpu @ 0123456789ab")
    assert f"no worker of pool '{pool}' started testing kernels-gpu within 3s" in why
    lines = _waiting(run_log)
    assert len(lines) >= 3, run_log  # one at once, then one every half second of the 3 s
    for line in lines:
        assert f"waiting for a worker of pool '{pool}' to start testing kernels-gpu" in line
        assert "flow run test kernels-gpu @ 0123456789ab, Scheduled" in line
        assert f"no live worker in pool '{pool}' (start one: prefect worker start --pool {pool})" in line
        assert re.search(r"\d+ s left before it is cancelled", line), line
    assert "3 s left" in lines[0] and "3 s left" not in lines[-1], "the time left counts down"


def test_a_dispatch_waiting_on_a_pool_with_a_live_worker_names_the_worker(prefect_server, tmp_path, run_log):
    pool = f"wait-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    with get_client(sync_client=True) as client:  # a worker that heartbeats and never takes the run
        client.send_worker_heartbeat(pool, "gpu-node-7", heartbeat_interval_seconds=30)
    _dispatch_in_a_flow(pool, tmp_path, 1, Waiting(poll_s=0.05, log_every_s=0.3))
    lines = _waiting(run_log)
    assert lines and all(f"waiting for pool '{pool}' (live workers: gpu-node-7) to start" in line for line in lines)


def _dispatched(run_id: str) -> list:
    with get_client(sync_client=True) as client:
        return [r for r in client.read_flow_runs() if r.parameters.get("run_id") == run_id]


@pytest.mark.slow
def test_a_flow_interrupted_while_its_suite_waits_cancels_the_dispatched_run(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "1")  # the suite could run here: it waits for its pool's worker
    pool = f"stop-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    config = config_with_pool(pool, deadline_s=600)
    run = _record(tmp_path)

    @flow
    def parent():
        with cancel_dispatched_on_exit("the parent"):
            dispatching.dispatch_suite.submit(config, config.suites_by_name["kernels-gpu"], f"test/{pool}", run)
            until(lambda: _dispatched(run.run_id), bool, deadline_s=120)
            # An interrupt in the flow's thread (Prefect's TerminationSignal for SIGTERM would also re-send the
            # signal to this process once the engine has handled it: tests/flows/test_dispatch_stop.py).
            raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        parent()
    assert time.monotonic() - start < 120, "the suite's 600 s wait ended with its dispatcher"
    (dispatched,) = _dispatched(run.run_id)
    assert dispatched.state.is_cancelled(), dispatched.state
    assert "the parent" in dispatched.state.message and "KeyboardInterrupt" in dispatched.state.message
