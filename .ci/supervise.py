#!/usr/bin/env python3
"""Run CI's test command, then end every process it started — and nothing else.

``supervise.py [--deadline S] [--grace S] -- COMMAND...`` runs COMMAND in a
session of its own, as a child of this process, and exits with its status
(124 past the deadline, 128+N when this process got signal N).

This process makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): a
server that detaches from the test that started it (Kiln's local Prefect
server and its daemon start in sessions of their own; PostgreSQL runs under
``runuser``) is re-parented here, not to init, when its parent exits. So
every process the command started stays below this one in the process tree,
and at exit the leftovers are found by walking that tree down from this PID:
SIGTERM, then SIGKILL after ``--grace`` seconds. Nothing is matched by name
or command line, so other users' processes, concurrent ``kiln`` commands and
other jobs' servers are never touched. Each process is signalled through a
pidfd opened while it was still below this one, so a reused PID is never hit.

Standard library only: CI runs it with the system's python3 before any
environment exists.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.2  # how often the grace period looks whether the leftovers are gone


class Stop(Exception):
    """Raised by the signal handler: the deadline passed (SIGALRM) or someone asked this run to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(message: str) -> None:
    print(f".ci/supervise: {message}", file=sys.stderr, flush=True)


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        say(f"cannot become a child subreaper ({os.strerror(ctypes.get_errno())}): a process that detaches "
            "and outlives its parent is not found at exit")


def parents() -> dict[int, int]:
    """pid → parent pid of every process now (those that vanish while being read are left out)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold anything
        except OSError:
            continue
        found[int(entry)] = int(fields[1])
    return found


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def signal_descendants(root: int, sig: int) -> set[int]:
    """Send ``sig`` to every process below ``root``; the pids it reached."""
    handles = {}
    for pid in descendants(root):
        try:
            handles[pid] = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
    reached = set()
    try:
        still = descendants(root)  # a pid reused between the listing and pidfd_open is not below root: skipped
        for pid, handle in handles.items():
            if pid in still:
                try:
                    signal.pidfd_send_signal(handle, sig)
                    reached.add(pid)
                except ProcessLookupError:
                    pass
    finally:
        for handle in handles.values():
            os.close(handle)
    return reached


def reap() -> None:
    """Collect every exited child (orphans re-parented here are children too)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_leftovers(root: int, grace_s: float) -> None:
    """SIGTERM everything below ``root``, SIGKILL what is left after ``grace_s``; return once none is left."""
    left = descendants(root)
    if not left:
        return
    say(f"ending {len(left)} process(es) the command left running:")
    for pid in sorted(left):
        say(f"  pid {pid}: {command_line(pid)}")
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        signal_descendants(root, sig)
        end = time.monotonic() + wait_s
        while True:
            reap()
            if not descendants(root):
                return
            if time.monotonic() > end:
                break
            time.sleep(POLL_S)
    say(f"still running after SIGKILL: {sorted(descendants(root))}")


def wait_for(pid: int) -> int:
    """Reap children until ``pid`` exits; its exit status (128+N for signal N)."""
    while True:
        child, status = os.waitpid(-1, 0)
        if child == pid:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


_stopping = False


def _stop(signum: int, _frame: object) -> None:
    global _stopping
    if not _stopping:  # once stopping, further signals are ignored: a second Ctrl-C must not skip the cleanup
        _stopping = True
        raise Stop(signum)


def supervise(command: Sequence[str], deadline_s: float, grace_s: float) -> int:
    global _stopping
    become_subreaper()
    for sig in (*STOP_SIGNALS, signal.SIGALRM):
        signal.signal(sig, _stop)
    try:
        # A signal that lands inside Popen loses `proc`, not the child: the cleanup walks the tree.
        proc = subprocess.Popen(list(command), start_new_session=True)
        signal.setitimer(signal.ITIMER_REAL, deadline_s)
        status = proc.returncode = wait_for(proc.pid)
    except Stop as stop:
        status = 124 if stop.signum == signal.SIGALRM else 128 + stop.signum
        say(f"the command ran past {deadline_s:g} s" if status == 124 else f"stopped by {stop}")
    finally:
        _stopping = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        end_leftovers(os.getpid(), grace_s)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--deadline", type=float, default=80 * 60, help="seconds the command may run")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs="+")
    ns = parser.parse_args(argv)
    return supervise(ns.command, ns.deadline, ns.grace)


if __name__ == "__main__":
    sys.exit(main())
