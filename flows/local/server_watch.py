"""The watchdog of Kiln's local Prefect server: it starts the server and ends it when it is not wanted any more.

``prefect server start`` is Prefect's own process and would run for ever:
a test or a script that deletes its ``PREFECT_HOME`` left its server polling a
database nobody can reach. Kiln starts the server through this small process
instead::

    python -P -m kiln.flows.local.server_watch --home HOME --idle-s S --check-s C -- COMMAND...

It starts COMMAND (the server) in a process group of its own, which gets
SIGTERM if the watchdog itself dies, and every ``--check-s`` seconds ends that
group (SIGTERM, then SIGKILL after a grace) and exits when

- HOME is gone (removed, or replaced by another directory), or
- no ``kiln`` command used the server for ``--idle-s`` seconds (the mtime of
  ``kiln-server.used``, and "now" while a command holds its lock).

SIGTERM, SIGINT or SIGHUP to the watchdog ends the server the same way
(``kiln server stop``). When the server exits on its own, so does the watchdog,
with its status. :func:`list_servers` finds every watchdog of this user in
``/proc`` (no registry that could go stale).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kiln.flows.local.server_home import USED_FILE, in_use, last_used
from kiln.tasks.process import PopenChild, terminate

_log = logging.getLogger(__name__)

MODULE = "kiln.flows.local.server_watch"
DEFAULT_IDLE_S = 86400.0  # a day: a release waiting for its approval overnight keeps its server
DEFAULT_CHECK_S = 30.0
STOP_GRACE_S = 10.0  # below kiln.flows.local.server.STOP_GRACE_S: `kiln server stop` waits for the whole ladder
_PR_SET_PDEATHSIG = 1


class _Stop(Exception):
    """A signal asked the watchdog to end the server."""


def seconds_setting(env: dict[str, str] | os._Environ[str], name: str, default: float) -> float:
    """A positive number of seconds from ``env[name]``; ``default`` (with a warning naming it) otherwise."""
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        _log.warning("%s=%r is not a positive number of seconds; using %g", name, raw, default)
        return default
    return value


def _home_id(home: Path) -> tuple[int, int] | None:
    try:
        info = home.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def why_stop(home: Path, home_id: tuple[int, int] | None, idle_s: float, started: float, now: float) -> str:
    """Why the server should end now ("" while it is wanted)."""
    if home_id is None or _home_id(home) != home_id:
        return f"its Prefect home {home} is gone"
    if in_use(home):
        os.utime(home / USED_FILE)
        return ""
    idle = now - last_used(home, started)
    if idle > idle_s:
        return f"no kiln command used it for {idle:.0f} s (KILN_SERVER_IDLE_SECONDS={idle_s:g})"
    return ""


def _die_with_parent(libc: ctypes.CDLL, parent: int) -> None:
    """In the server's process, before exec: SIGTERM when the watchdog dies, even by SIGKILL."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the watchdog died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _spawn(command: Sequence[str]) -> subprocess.Popen[bytes]:
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it
    parent = os.getpid()
    _log.info("starting %s", " ".join(command))
    return subprocess.Popen(list(command), stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                            preexec_fn=lambda: _die_with_parent(libc, parent))


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def watch(command: Sequence[str], home: Path, idle_s: float, check_s: float) -> int:
    """Run the server until it exits or is not wanted; the server's exit status (0 when we ended it)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    home_id, started = _home_id(home), time.time()
    server = _spawn(command)
    try:
        while True:
            try:
                return server.wait(timeout=check_s)
            except subprocess.TimeoutExpired:
                pass
            reason = why_stop(home, home_id, idle_s, started, time.time())
            if reason:
                _log.warning("stopping the Prefect server pid %d: %s", server.pid, reason)
                break
    except _Stop as stop:
        _log.info("stopping the Prefect server pid %d: the watchdog got %s", server.pid, stop)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # one ladder; a second signal must not cut it short
    terminate(PopenChild(server), STOP_GRACE_S, dump=False)
    return 0


@dataclass(frozen=True)
class Watched:
    """A watchdog of this user found in /proc: its pid, home and the server's port."""

    pid: int
    home: Path
    port: int


def _parse_argv(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S)
    parser.add_argument("--check-s", type=float, default=DEFAULT_CHECK_S)
    parser.add_argument("command", nargs="+")
    return parser.parse_args(argv)


def _watched(pid: int, uid: int) -> Watched | None:
    proc = Path(f"/proc/{pid}")
    try:
        if proc.stat().st_uid != uid:
            return None
        args = [a.decode("utf-8", "replace") for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return None
    if MODULE not in args:
        return None
    rest = args[args.index(MODULE) + 1:]
    if "--" in rest:
        rest = rest[:rest.index("--")] + ["--", "x"]
    try:
        ns = _parse_argv(rest)
    except SystemExit:
        return None
    return Watched(pid, ns.home, ns.port)


def list_servers(uid: int | None = None) -> list[Watched]:
    """Every live watchdog of ``uid`` (this user by default), by home."""
    uid = os.getuid() if uid is None else uid
    found = [w for entry in os.scandir("/proc") if entry.name.isdigit()
             if (w := _watched(int(entry.name), uid)) is not None]
    return sorted(found, key=lambda w: (str(w.home), w.pid))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kiln-server-watch[%(process)d] %(message)s")
    ns = _parse_argv(sys.argv[1:] if argv is None else argv)
    return watch(ns.command, ns.home, ns.idle_s, ns.check_s)


if __name__ == "__main__":
    sys.exit(main())
