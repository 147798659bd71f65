"""The processes a command started in its own process group, found in ``/proc``.

Kiln's long-lived children lead groups of their own and are ended through the
registry of :mod:`kiln.tasks.process`. What a step runs with a plain
``subprocess.run`` (git, pip, uv) stays in the command's group, where no
``killpg`` may reach: the group can hold the shell or CI runner that started
the command. On cancellation those are found here instead: descendants of
this process, in its group, started after the command began (so an in-process
caller's own children, started before, are never touched).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PROC = Path("/proc")
POLL_S = 0.05


@dataclass(frozen=True)
class ProcEntry:
    pid: int
    state: str
    ppid: int
    pgrp: int
    start_ticks: int


def _entry(pid: int) -> ProcEntry | None:
    try:
        # /proc/PID/stat: "pid (comm) state ppid pgrp session tty tpgid flags ... starttime(22nd)"
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return ProcEntry(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def proc_table() -> list[ProcEntry]:
    """Every process this user can see (empty where there is no ``/proc``)."""
    if not PROC.is_dir():
        return []
    entries = (_entry(int(p.name)) for p in PROC.iterdir() if p.name.isdigit())
    return [e for e in entries if e is not None]


def now_ticks() -> int:
    """The current time in the clock of ``/proc/PID/stat``'s start time (ticks since boot)."""
    try:
        uptime = float((PROC / "uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def own_group_descendants(since_ticks: int, root: int | None = None) -> list[int]:
    """Live descendants of ``root`` (this process) in its process group, started at or after ``since_ticks``."""
    root = os.getpid() if root is None else root
    group = os.getpgid(root)
    table = proc_table()
    children: dict[int, list[ProcEntry]] = {}
    for entry in table:
        children.setdefault(entry.ppid, []).append(entry)
    found, stack = [], list(children.get(root, []))
    while stack:
        entry = stack.pop()
        stack.extend(children.get(entry.pid, []))
        if entry.pgrp == group and entry.state != "Z" and entry.start_ticks >= since_ticks:
            found.append(entry.pid)
    return sorted(found)


def _alive(pid: int) -> bool:
    entry = _entry(pid)
    return entry is not None and entry.state != "Z"


def end_descendants(since_ticks: int, grace_s: float = 2.0) -> list[int]:
    """SIGTERM what :func:`own_group_descendants` finds, SIGKILL what is left after ``grace_s``; their pids."""
    found = pids = own_group_descendants(since_ticks)
    if not pids:
        return []
    logger.warning("ending %d process(es) this command started in its own group: %s", len(pids), pids)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
        end = time.monotonic() + wait_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(POLL_S)
        pids = [pid for pid in pids if _alive(pid)]
        if not pids:
            break
    return found
