"""Waiting on a dispatched flow run: never silent, never past the dispatcher.

A dispatched unit waits for a worker of its pool to start its flow run, then
for the run to end, up to the unit's deadline. Every wait says what it waits
for: a log line at once and then every ``log_every_s`` (a minute) naming the
pool, the flow run, its state, whether the pool has a live worker, and the
time left. Whether a pool has a live worker comes from the workers' own
heartbeats (the server's foreman marks a silent worker offline only after
several missed heartbeats; the same rule is applied here, so a server that
runs no foreman does not count a dead worker as live).

The flow that dispatched a run stops waiting when it stops itself: a flow
that raises (a failure, KeyboardInterrupt, a termination signal turned into
an exception) inside :func:`cancel_dispatched_on_exit` cancels every run it
dispatched that is still in flight, and wakes the threads waiting on them,
before the exception goes on; a wait also ends when Kiln's signal handler
marks the process as stopping (:func:`kiln.tasks.process.request_cancel`). Waits run on task threads while the signal
lands on the main thread, so the wake-up goes through an event per
dispatching flow run, not through the exception itself.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun, Worker, WorkerStatus
from prefect.exceptions import MissingContextError, ObjectNotFound
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Cancelled

from kiln.tasks.process import RunCancelledError, cancel_requested

logger = logging.getLogger(__name__)

# A worker is live while its last heartbeat is at most this many of its intervals old (Prefect's
# foreman uses the same multiple and fallback interval to mark workers offline).
MISSED_HEARTBEATS = 3
FALLBACK_HEARTBEAT_S = 30


class DispatchStoppedError(RunCancelledError):
    """The flow that dispatched a unit stopped while the unit's flow run was in flight (it was cancelled)."""


@dataclass(frozen=True)
class Waiting:
    """How a dispatch waits: how often it polls its flow run and how often it says what it waits for."""

    poll_s: float = 2.0  # a dispatched unit's end is seen within 2 s: one API read per unit in flight
    log_every_s: float = 60.0
    clock: Callable[[], float] = time.monotonic


def start_hint(pool: str) -> str:
    return f"start one: prefect worker start --pool {pool}"


def no_live_worker(pool: str) -> str:
    return f"no live worker in pool {pool!r} ({start_hint(pool)})"


def worker_is_live(worker: Worker, now: datetime.datetime) -> bool:
    """Whether ``worker`` (Prefect's Worker) is online and sent a heartbeat recently enough."""
    beat = worker.last_heartbeat_time
    if worker.status != WorkerStatus.ONLINE or beat is None:
        return False
    interval = worker.heartbeat_interval_seconds or FALLBACK_HEARTBEAT_S
    age_s: float = (now - beat).total_seconds()
    return age_s <= interval * MISSED_HEARTBEATS


def live_workers(pool: str, client: SyncPrefectClient | None = None) -> list[str]:
    """The names of ``pool``'s live workers (none for a pool the server does not have)."""
    if client is None:
        with get_client(sync_client=True) as own:
            return live_workers(pool, own)
    try:
        workers = client.read_workers_for_work_pool(pool)
    except ObjectNotFound:
        return []
    now = datetime.datetime.now(datetime.UTC)
    return sorted(w.name for w in workers if worker_is_live(w, now))


def time_left(seconds: float) -> str:
    """``3 min 5 s``, ``45 s``, ``1 h 2 min``: how long a wait may still last."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def waiting_line(pool: str, what: str, flow_run: FlowRun, left_s: float, workers: list[str]) -> str:
    """What a dispatch waits for, in one log line: the pool, the flow run and its state, the time left."""
    state = flow_run.state.name if flow_run.state else "unscheduled"
    run = f"flow run {flow_run.name}, {state}"
    left = f"{time_left(left_s)} left before it is cancelled"
    if flow_run.state is not None and flow_run.state.is_running():
        return f"waiting for {what} on pool {pool!r} ({run}): {left}"
    if not workers:
        return f"waiting for a worker of pool {pool!r} to start {what} ({run}): {no_live_worker(pool)}; {left}"
    return f"waiting for pool {pool!r} (live workers: {', '.join(workers)}) to start {what} ({run}): {left}"


@dataclass
class _Owner:
    """The runs one dispatching flow run has in flight, and the event that stops its waits."""

    stop: threading.Event = field(default_factory=threading.Event)
    in_flight: dict[Any, str] = field(default_factory=dict)  # flow run id → its name


_owners: dict[str, _Owner] = {}
_lock = threading.Lock()


def say(line: str) -> None:
    """Log ``line`` where a person watching the run sees it: the run's own log (console and UI).

    Kiln's ``kiln.*`` loggers pass INFO lines only as far as the root logger's level (WARNING under
    Prefect's logging): a wait that said what it waits for through them would still be silent.
    """
    try:
        get_run_logger().info(line)
    except MissingContextError:  # called outside a flow or task run (a script, a unit test)
        logger.info(line)


def _owner_id() -> str:
    return current_flow_run.get_id() or "-"


def cancel_run(flow_run_id: UUID, name: str, why: str) -> None:
    """A run given up on must not start later, on a worker that comes up after its dispatcher stopped."""
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(message=why), force=True)
        logger.warning("cancelled flow run %s: %s", name, why)
    except Exception as exc:  # the unit has ended either way; say why the run could not be cancelled
        logger.warning("could not cancel flow run %s: %s", name, exc)


def cancel_dispatched(owner: str, why: str) -> list[str]:
    """Cancel every run ``owner`` dispatched that is still in flight, and wake its waits; their names."""
    with _lock:
        entry = _owners.setdefault(owner, _Owner())
        entry.stop.set()
        in_flight = dict(entry.in_flight)
    for run_id, name in in_flight.items():
        cancel_run(run_id, name, why)
    return sorted(in_flight.values())


@contextmanager
def cancel_dispatched_on_exit(what: str) -> Iterator[None]:
    """Around a flow body that dispatches: if it raises, what it dispatched is cancelled first."""
    owner = _owner_id()
    with _lock:
        _owners[owner] = _Owner()
    try:
        yield
    except BaseException as exc:
        cancelled = cancel_dispatched(owner, f"{what} (flow run {owner}), which dispatched it, stopped: "
                                             f"{type(exc).__name__}")
        if cancelled:
            logger.warning("%s stopped (%s): cancelled the runs it dispatched: %s", what, type(exc).__name__,
                           ", ".join(cancelled))
        raise
    finally:
        with _lock:
            _owners.pop(owner, None)


def _track(flow_run: FlowRun) -> tuple[str, _Owner]:
    owner = _owner_id()
    with _lock:
        entry = _owners.setdefault(owner, _Owner())
        entry.in_flight[flow_run.id] = flow_run.name
    return owner, entry


def _untrack(entry: _Owner, flow_run: FlowRun) -> None:
    with _lock:
        entry.in_flight.pop(flow_run.id, None)


def wait_for_run(flow_run: FlowRun, pool: str, what: str, deadline_s: float, waiting: Waiting = Waiting()) -> FlowRun:
    """``flow_run`` once it is final or its deadline passed (then still in flight), saying what it waits for.

    Raises :class:`DispatchStoppedError` when the dispatching flow stopped (the run was cancelled);
    any exception here (an interrupt) cancels the run before it goes on.
    """
    owner, entry = _track(flow_run)
    start = waiting.clock()
    next_line = start
    if entry.stop.is_set():  # dispatched after its dispatcher began to stop: cancel_dispatched missed it
        cancel_run(flow_run.id, flow_run.name, f"{what}: the flow that dispatched it (flow run {owner}) stopped")
    try:
        with get_client(sync_client=True) as client:
            while True:
                flow_run = client.read_flow_run(flow_run.id)
                left = deadline_s - (waiting.clock() - start)
                if (flow_run.state is not None and flow_run.state.is_final()) or left <= 0:
                    return flow_run
                if waiting.clock() >= next_line:
                    running = flow_run.state is not None and flow_run.state.is_running()
                    say(waiting_line(pool, what, flow_run, left, [] if running else live_workers(pool, client)))
                    next_line += waiting.log_every_s
                owner_stopped = entry.stop.wait(min(waiting.poll_s, max(left, 0.01)))  # it cancelled the run
                if owner_stopped or cancel_requested():
                    if not owner_stopped:
                        cancel_run(flow_run.id, flow_run.name, f"{what}: the run that dispatched it is being cancelled")
                    raise DispatchStoppedError(f"{what} was cancelled on pool {pool!r} (flow run {flow_run.name}): "
                                               f"the flow that dispatched it stopped")
    except DispatchStoppedError:
        raise  # cancelled already
    except BaseException as exc:
        cancel_run(flow_run.id, flow_run.name, f"{what}: its dispatcher stopped waiting ({type(exc).__name__})")
        raise
    finally:
        _untrack(entry, flow_run)
