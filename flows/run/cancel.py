"""One signal stops everything (invariant 11): SIGTERM or Ctrl-C ends the flow run Cancelled.

Prefect's flow engine turns SIGTERM into :class:`TerminationSignal` through a
handler of its own (its "SIGTERM bridge", installed by every flow and subflow
run). Left alone, that ends a ``kiln`` command's run Crashed, and only after
the engine's task runner has waited for every task thread: threads that wait
on compile workers, test processes and dispatched runs nobody told to stop (a
nightly went on for minutes after its SIGTERM, and a second one crashed it).

Kiln's handler takes the bridge's place (:func:`arm`, as Prefect's own, so
nested subflows keep it too) and, on the first signal:

1. marks the process as stopping (:func:`kiln.tasks.process.request_cancel`):
   pools and runners start nothing more and their waits end;
2. ends every process group Kiln registered, with the ladder (stack dump,
   SIGTERM, grace, SIGKILL), and on the command line also what the command
   ran in its own group (:mod:`kiln.tasks.descendants`), on a thread: the
   main thread must unwind at once;
3. on the ``kiln`` command line, records the cancel intent Prefect's engine
   reads, so every flow run on the stack ends Cancelled, not Crashed (under a
   worker, a cancel from the UI records it itself before its SIGTERM);
4. raises :class:`TerminationSignal` in the main thread.

A second signal ends the process at once: SIGKILL to every registered group,
exit status 128 + the signal.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

import prefect.utilities.engine as prefect_engine
from prefect._internal import control_listener
from prefect.exceptions import TerminationSignal

from kiln.tasks.descendants import end_descendants, now_ticks
from kiln.tasks.process import end_all, live_groups, request_cancel, reset_cancel, signal_group

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How long the command waits, after its flow unwound, for the ladder to finish with every group.
STOP_WAIT_S = 20.0
#: The names in Prefect this module relies on (a test checks an upgrade still has them).
PREFECT_NAMES = ("prefect.utilities.engine._prefect_sigterm_handler", "prefect._internal.control_listener._set_intent")

_lock = threading.Lock()
_stopper: threading.Thread | None = None
_command_since: int | None = None  # set while a ``kiln`` command owns this process's signals


def exit_status(signum: int) -> int:
    """The shell's status for a command ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def _stop_children(since: int | None) -> None:
    ended = end_all()
    if ended:
        logger.warning("ended %d process group(s) Kiln started: %s", len(ended),
                       ", ".join(f"{pid} ({r.escalation})" for pid, r in sorted(ended.items())))
    if since is not None:
        end_descendants(since)


def _exit_at_once(signum: int) -> NoReturn:
    for pid in live_groups():
        signal_group(pid, signal.SIGKILL)
    print(f"\nkiln: second {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
    os._exit(exit_status(signum))


def _on_signal(signum: int, frame: FrameType | None) -> NoReturn:
    """The handler for SIGTERM (as Prefect's bridge) and, on the command line, SIGINT."""
    global _stopper
    with _lock:
        second = _stopper is not None
        if not second:
            request_cancel(f"{signal.Signals(signum).name} received")
            _stopper = threading.Thread(target=_stop_children, args=(_command_since,), name="kiln-cancel",
                                        daemon=True)
            _stopper.start()
    if second:
        _exit_at_once(signum)
    if _command_since is not None:
        _set_intent = getattr(control_listener, "_set_intent", None)
        if _set_intent is not None:
            _set_intent("cancel")  # what Prefect's runner records before it cancels a run: Cancelled, not Crashed
    raise TerminationSignal(signal=signum)


def arm() -> None:
    """Make :func:`_on_signal` Prefect's SIGTERM bridge in this process (idempotent).

    Prefect looks its bridge up by this module-level name each time a flow run
    installs it, and compares handlers against it; replacing it before any flow
    runs keeps both consistent. Called on import of :mod:`kiln.flows.run.common`,
    so a deployment run's process (``prefect flow-run execute``) has it too.
    """
    if not hasattr(prefect_engine, "_prefect_sigterm_handler"):
        logger.warning("this Prefect has no SIGTERM bridge to replace: a SIGTERM ends a run Crashed and "
                       "leaves Kiln's worker processes to their deadlines")
        return
    if prefect_engine._prefect_sigterm_handler is not _on_signal:
        prefect_engine._prefect_sigterm_handler = _on_signal  # type: ignore[assignment]
        # A deployment run's process exits as soon as its engine unwinds: the ladder finishes first.
        atexit.register(wait_stopped)


@contextmanager
def command_signals() -> Iterator[None]:
    """Around one ``kiln`` command in this process: SIGTERM and SIGINT cancel it (see the module)."""
    global _command_since, _stopper
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; a caller elsewhere keeps its own handling
        return
    arm()
    reset_cancel()
    control_listener.clear_intent()
    _command_since = now_ticks()
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    try:
        yield
    finally:
        wait_stopped()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with _lock:
            _command_since, _stopper = None, None
        control_listener.clear_intent()


def wait_stopped() -> None:
    """Wait (bounded) until the ladder is done with every group the first signal set out to end."""
    stopper = _stopper
    if stopper is not None:
        stopper.join(STOP_WAIT_S)


def cancelled_status(command: str, run: Callable[[], int]) -> int:
    """``run()``'s status, or 128 + the signal when a signal cancelled it (with a line saying so)."""
    try:
        return run()
    except TerminationSignal as exc:
        wait_stopped()
        name = signal.Signals(exc.signal).name
        print(f"\nkiln {command}: cancelled by {name}; its flow run is Cancelled and every process it "
              f"started was ended", file=sys.stderr)
        return exit_status(exc.signal)
