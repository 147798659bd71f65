"""The deadline ladder: dump stacks → SIGTERM the group → grace → SIGKILL → reap.

Every process Kiln starts for a test, a rank, a build worker or an external
tool is the leader of its own process group, so one ``killpg`` reaches
whatever it started (ranks, servers, helpers, compiler subprocesses). The
parent waits only with bounds: the child's deadline, a short window for the
stack dump, the grace period, and a last bounded wait after SIGKILL. After
the child is gone its group gets one more SIGKILL, because a test can exit
normally and leave a grandchild behind.

Cancellation (invariant 11): every group Kiln starts is in a process-wide
registry while it lives (:func:`register`; :func:`watch` registers what it
waits for), so one SIGTERM or Ctrl-C can end them all with the same ladder
(:func:`end_all`). :func:`request_cancel` marks the process as stopping: pools
and runners check it (:func:`check_cancelled`) before they start anything, and
a group registered after it is ended at once.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from kiln.core.errors import CompileError, PermanentError

logger = logging.getLogger(__name__)

# Children register faulthandler on this signal (see ``install_stack_dump``).
DUMP_SIGNAL = signal.SIGUSR1
DUMP_WINDOW_S = 1.0
KILL_WAIT_S = 5.0
POLL_S = 0.02

Escalation = Literal["exited", "sigterm", "sigkill", "unreaped"]


class Child(Protocol):
    """A started process: its pid leads its own process group."""

    pid: int

    def wait(self, timeout: float) -> int | None:
        """The exit status (negative: killed by that signal), or None if still running."""


class PopenChild:
    """A ``subprocess.Popen`` (started with ``start_new_session=True``) as a :class:`Child`."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc, self.pid = proc, proc.pid

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


@dataclass(frozen=True)
class LadderResult:
    returncode: int | None
    timed_out: bool
    escalation: Escalation
    stacks: str = ""
    elapsed_s: float = 0.0


def install_stack_dump(path: str | os.PathLike[str]) -> TextIO:
    """In a child: dump every thread's stack to ``path`` on DUMP_SIGNAL and on a fatal signal.

    Returns the open file; it must stay open for the life of the process.
    """
    import faulthandler

    handle = open(path, "w", buffering=1)
    faulthandler.enable(file=handle, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    return handle


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a forked child: die if the fork server dies, so a lost server leaves no child behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the runner's killpg still reaches the group


def gpu_initialised() -> bool:
    """Whether torch has initialised CUDA in this process: a fork after that hangs or corrupts the child."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def single_threaded() -> int | None:
    """Hold a fork server's torch to one intra-op thread; the count each child restores (None: no torch).

    A child forked after OpenMP started its thread pool inherits a pool with
    no threads and hangs in its first parallel op, so the pool must start in
    the child, at the count a fresh process would have.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    threads: int = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


class Mailboxes:
    """A queue per key for what one reader thread receives; once the sender is gone every waiter gets None.

    ``lock`` and ``lost`` are for the owner too: a command sent under ``lock``
    after checking ``lost`` cannot race the reader's end.
    """

    def __init__(self) -> None:
        self._queues: dict[Any, queue.Queue[Any]] = {}
        self.lock, self.lost = threading.Lock(), False

    # Any: any hashable key the caller chooses
    def box(self, key: Any) -> queue.Queue[Any]:
        with self.lock:
            if key not in self._queues:
                self._queues[key] = queue.Queue()
                if self.lost:
                    self._queues[key].put(None)
            return self._queues[key]

    def lose(self) -> None:
        """The sender is gone: wake everyone who waits, and everyone who will."""
        with self.lock:
            self.lost = True
            for waiting in self._queues.values():
                waiting.put(None)


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the group led by ``pid``; False when no process of it is left."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's process
        logger.warning("not allowed to signal process group %d; it is not ours any more", pid)
        return False


def group_alive(pid: int) -> bool:
    """True while a process of the group led by ``pid`` runs (zombies do not count:
    they are dead and only wait for init to reap them)."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces or ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pid and fields[0] != "Z":
            return True
    return False


def kill_group(pid: int, wait_s: float = 1.0) -> None:
    """SIGKILL whatever is left of the group, then wait (bounded) until it is gone.

    Killed grandchildren are reaped by init, not by us; the short wait lets a
    caller that checks right after see them gone rather than as zombies.
    """
    if not signal_group(pid, signal.SIGKILL):
        return
    end = time.monotonic() + wait_s
    while group_alive(pid) and time.monotonic() < end:
        time.sleep(POLL_S)


def _read_stacks(path: Path | None, before: int) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(before)
        return handle.read().decode("utf-8", "replace")


def dump_stacks(child: Child, stack_path: Path | None, window_s: float = DUMP_WINDOW_S) -> str:
    """Ask the child for its stacks and wait (bounded) until the dump stops growing."""
    if stack_path is None:
        return ""
    before = stack_path.stat().st_size if stack_path.exists() else 0
    try:
        os.kill(child.pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return ""
    end = time.monotonic() + window_s
    last = -1
    while time.monotonic() < end:
        size = stack_path.stat().st_size if stack_path.exists() else 0
        if size > before and size == last:
            break
        last = size
        time.sleep(0.05)
    return _read_stacks(stack_path, before)


def terminate(child: Child, grace_s: float, stack_path: Path | None = None, dump: bool = True) -> LadderResult:
    """The ladder without the wait: dump, SIGTERM the group, grace, SIGKILL, reap."""
    start = time.monotonic()
    stacks = dump_stacks(child, stack_path) if dump else ""
    logger.warning("pid %d: sending SIGTERM to its process group", child.pid)
    signal_group(child.pid, signal.SIGTERM)
    grace_end = time.monotonic() + grace_s
    code = child.wait(grace_s)
    while code is not None and group_alive(child.pid) and time.monotonic() < grace_end:
        time.sleep(POLL_S)  # grandchildren get the same grace as the leader
    escalation: Escalation = "sigterm"
    if code is None or group_alive(child.pid):
        logger.warning("pid %d: grace of %.1fs over; sending SIGKILL to its process group", child.pid, grace_s)
        signal_group(child.pid, signal.SIGKILL)
        escalation = "sigkill"
        if code is None:
            code = child.wait(KILL_WAIT_S)
            escalation = "sigkill" if code is not None else "unreaped"
        kill_group(child.pid)
    return LadderResult(code, True, escalation, stacks, time.monotonic() - start)


def run_in_group(cmd: list[str], timeout_s: float, cwd: Path | None = None, env: Mapping[str, str] | None = None,
                 grace_s: float = 5.0) -> tuple[LadderResult, str]:
    """Run ``cmd`` in a process group of its own, held to ``timeout_s`` by the shared ladder; its result and
    its output (stdout and stderr together, read from a file: nobody reads a pipe while the ladder waits).
    Its stdin is ``/dev/null``: a batch step (a registry's import, a compiler, a suite) never reads the
    terminal or pipe Kiln was started with, and one that tries reads end-of-file instead of waiting."""
    logger.info("running %s", " ".join(cmd))
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        ladder = run_with_deadline(PopenChild(proc), timeout_s, grace_s=grace_s)
        output.seek(0)
        return ladder, output.read().decode("utf-8", "replace")


def run_with_deadline(
    child: Child,
    deadline_s: float,
    grace_s: float = 2.0,
    stack_path: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> LadderResult:
    """Wait for ``child`` at most ``deadline_s``; past it, climb the ladder."""
    end = clock() + max(deadline_s, 0.0)
    return watch(child, lambda: end, grace_s, stack_path, clock)


def watch(
    child: Child,
    deadline: Callable[[], float],
    grace_s: float = 2.0,
    stack_path: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.05,
) -> LadderResult:
    """Wait for ``child`` until ``deadline()`` (re-read at every poll, so it can move
    as the child reports progress); past it, climb the ladder.

    Whatever happens, the child's process group is SIGKILLed at the end so no
    grandchild outlives the test. While it is waited for, the group is
    registered (a cancellation ends it through :func:`end_all`).
    """
    register(child, stack_path, grace_s)
    try:
        return _watch(child, deadline, grace_s, stack_path, clock, poll_s)
    finally:
        unregister(child)


def _watch(child: Child, deadline: Callable[[], float], grace_s: float, stack_path: Path | None,
           clock: Callable[[], float], poll_s: float) -> LadderResult:
    start = clock()
    while True:
        remaining = deadline() - clock()
        code = child.wait(min(poll_s, max(remaining, 0.0)))
        if code is not None:
            kill_group(child.pid)  # a test can exit and leave a grandchild behind
            return LadderResult(code, False, "exited", "", clock() - start)
        if clock() >= deadline():
            break
    logger.warning("pid %d: deadline passed after %.1fs; dumping stacks", child.pid, clock() - start)
    result = terminate(child, grace_s, stack_path)
    return LadderResult(result.returncode, True, result.escalation, result.stacks, clock() - start)


class RunCancelledError(PermanentError):
    """The run is being cancelled (SIGTERM, Ctrl-C, a cancel from the UI): Kiln starts nothing more."""


@dataclass(frozen=True)
class _Group:
    child: Child
    stack_path: Path | None
    grace_s: float


_live: dict[int, _Group] = {}
_live_lock = threading.Lock()
_cancel = threading.Event()
_cancel_why: list[str] = []


def request_cancel(why: str) -> bool:
    """Mark this process as stopping (waits that check it stop); True the first time."""
    with _live_lock:
        first = not _cancel.is_set()
        if first:
            _cancel_why[:] = [why]
            _cancel.set()
    if first:
        logger.warning("cancelling: %s; ending every process group Kiln started", why)
    return first


def cancel_requested() -> bool:
    return _cancel.is_set()


def reset_cancel() -> None:
    """For a process that runs one command after another (the CLI called in-process): a fresh start."""
    with _live_lock:
        _cancel.clear()
        _cancel_why.clear()


def check_cancelled(what: str) -> None:
    """Raise :class:`RunCancelledError` instead of starting ``what`` once the run is being cancelled."""
    if _cancel.is_set():
        raise RunCancelledError(f"{what} was not started: the run is being cancelled ({_why()})")


def _why() -> str:
    return _cancel_why[0] if _cancel_why else "cancelled"


def register(child: Child, stack_path: Path | None = None, grace_s: float = 2.0) -> None:
    """Track ``child``'s process group until :func:`unregister`, so a cancellation can end it.

    Registered after cancellation began, the group is ended at once and
    :class:`RunCancelledError` is raised: whatever raced the signal dies with the rest.
    """
    with _live_lock:
        if not _cancel.is_set():
            _live[child.pid] = _Group(child, stack_path, grace_s)
            return
    terminate(child, grace_s, stack_path, dump=False)
    raise RunCancelledError(f"process group {child.pid} was ended as it started: the run is being cancelled "
                            f"({_why()})")


def unregister(child: Child) -> None:
    with _live_lock:
        entry = _live.get(child.pid)
        if entry is not None and entry.child is child:
            del _live[child.pid]


def live_groups() -> list[int]:
    """The leaders of the process groups registered now."""
    with _live_lock:
        return sorted(_live)


def end_all() -> dict[int, LadderResult]:
    """Every registered group down the ladder at once (a thread each); returns when all are gone."""
    with _live_lock:
        groups = list(_live.values())
    results: dict[int, LadderResult] = {}

    def end(group: _Group) -> None:
        dump = group.stack_path is not None
        results[group.child.pid] = terminate(group.child, group.grace_s, group.stack_path, dump=dump)

    threads = [threading.Thread(target=end, args=(g,), name=f"kiln-end-{g.child.pid}", daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for group in groups:
        unregister(group.child)
    return results


def signal_name(returncode: int | None) -> str | None:
    """``-11`` → ``"SIGSEGV"``; None for a normal exit."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


# How long a tool (a compiler, an installer) has between SIGTERM and SIGKILL when its deadline passes.
TOOL_GRACE_S = 5.0


def run_tool(cmd: list[str], timeout: float, cwd: Path | None = None,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run an external tool in its own process group, logged, held to its deadline by the shared ladder.

    ``env``: the tool's whole environment (default: this process's).
    """
    ladder, out = run_in_group(cmd, timeout, cwd, env, grace_s=TOOL_GRACE_S)  # no stacks: not a Python process
    if ladder.timed_out:
        raise CompileError(f"{cmd[0]} ran past its {timeout:g} s deadline; process group ended by"
                           f" {ladder.escalation}:\n{out[-2000:]}")
    return subprocess.CompletedProcess(cmd, ladder.returncode if ladder.returncode is not None else -9, out, "")
