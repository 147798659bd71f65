"""Kiln's build daemon, client side: run a flow command in a process that has Prefect imported already.

Every ``kiln`` command that runs a flow used to pay for starting Python and
importing Prefect and Kiln's flows (1.5-2 s here) before any work: more than
a warm build's own work. Like Gradle's daemon, the first such command starts
one long-lived process in the background (:mod:`kiln.flows.daemon_server`)
that imports all of that once and then forks a child per command. The
command itself runs in-process as before (it starts the daemon as it exits,
so the two never compete for the cores); later commands connect to the
daemon, pass it their argv, working directory, environment and stdin,
stdout and stderr (``SCM_RIGHTS``), and wait for the child's exit status.
Signals the client gets (Ctrl-C, SIGTERM) are forwarded to the child's
process group; if the client dies, the child is terminated.

A daemon serves only commands that would import exactly what it imported:
its key covers the interpreter, the site-packages (their mtimes change on
every install), Kiln's own source files (size and mtime), the working
directory and the settings Prefect reads at import (``PREFECT_*``, ``HOME``,
``PYTHONPATH``, the profiles file, ``.env`` and ``prefect.toml``), so editing Kiln or switching a profile never runs
stale code: it just gets (and starts) another daemon. Anything unexpected
before the child has started — no daemon, a refused or broken connection —
runs the command in-process instead, so the daemon can only make a command
faster, never make it fail.

``KILN_DAEMON=off`` turns it off; ``KILN_DAEMON_IDLE_SECONDS`` (default 900)
is how long an idle daemon waits before it exits. State lives in
``$TMPDIR/kiln-<uid>/`` (mode 0700; the socket checks the peer's uid too):
``<key>.sock``, ``<key>.lock`` (held by the daemon for its life, so one
daemon per key), ``<key>.log``.

No Prefect import here: this runs before the command's, and must be cheap.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

#: Commands that run a Prefect flow: the ones worth a warm process.
FLOW_COMMANDS = frozenset({"nightly", "release", "build", "test", "bench", "publish"})
#: The environment Prefect and Python read at import time (the rest is handed to the child).
_KEY_ENV_PREFIXES = ("PREFECT_",)
_KEY_ENV_NAMES = ("HOME", "PYTHONPATH", "PYTHONHOME", "TMPDIR")
#: Files in the working directory Prefect reads its settings from at import.
_CWD_SETTINGS_FILES = (".env", "prefect.toml", "pyproject.toml")
_SOURCE_DIRS = ("flows", "tasks", "release", "runtime")
DEFAULT_IDLE_SECONDS = 900.0
#: Largest message either side sends (the request carries the environment).
MAX_MESSAGE = 1 << 20
#: How long the client waits for the daemon to accept and fork (then it runs in-process).
HANDSHAKE_TIMEOUT_S = 10.0


def enabled(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return env.get("KILN_DAEMON", "auto").strip().lower() not in ("off", "0", "false", "no")


def state_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kiln-{os.getuid()}"


def _private_dir() -> Path | None:
    """The state directory, created 0700; None if it exists but is not ours alone."""
    path = state_dir()
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return path


def _source_files(root: Path) -> Iterator[tuple[str, int, int]]:
    for name in _SOURCE_DIRS:
        stack = [root / name]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if not entry.name.startswith(".") and entry.name != "__pycache__":
                        stack.append(Path(entry.path))
                elif entry.name.endswith(".py"):
                    info = entry.stat()
                    yield entry.path, info.st_size, info.st_mtime_ns


def _mtime(path: str | Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _profiles(env: dict[str, str] | os._Environ[str]) -> str:
    home = env.get("PREFECT_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".prefect")
    return env.get("PREFECT_PROFILES_PATH") or str(Path(home) / "profiles.toml")


def daemon_key(env: dict[str, str] | os._Environ[str], cwd: str) -> str:
    """What a daemon must share with a command to run it: 16 hex digits."""
    import site

    parts: dict[str, Any] = {
        "python": [os.path.realpath(sys.executable), sys.version, sys.prefix],
        "site": [(p, _mtime(p)) for p in site.getsitepackages()],
        "env": sorted((k, v) for k, v in env.items() if k.startswith(_KEY_ENV_PREFIXES) or k in _KEY_ENV_NAMES),
        "cwd": [cwd, *((name, _mtime(Path(cwd) / name)) for name in _CWD_SETTINGS_FILES)],
        "profiles": _mtime(_profiles(env)),
        "kiln": sorted(_source_files(Path(__file__).resolve().parent.parent)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def paths_for(key: str, directory: Path | None = None) -> tuple[Path, Path, Path]:
    """Socket, lock file and log of the daemon with this key."""
    base = directory or state_dir()
    return base / f"{key}.sock", base / f"{key}.lock", base / f"{key}.log"


def idle_seconds(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[float, str]:
    """How long an idle daemon waits, and what was wrong with ``KILN_DAEMON_IDLE_SECONDS`` ("" if nothing)."""
    raw = env.get("KILN_DAEMON_IDLE_SECONDS", "")
    if not raw:
        return DEFAULT_IDLE_SECONDS, ""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:  # also NaN
        return DEFAULT_IDLE_SECONDS, (f"KILN_DAEMON_IDLE_SECONDS={raw!r} is not a positive number of seconds; "
                                      f"using {DEFAULT_IDLE_SECONDS:g}")
    return value, ""


def spawn(key: str, cwd: str) -> None:
    """Start a daemon for ``key`` in the background (it exits at once if one already holds the key's lock)."""
    directory = _private_dir()
    if directory is None:
        return
    _, _, log = paths_for(key, directory)
    with open(log, "ab") as out:
        # A service, not a step: it ends itself after KILN_DAEMON_IDLE_SECONDS without a command.
        subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "kiln.flows.daemon_server", key], cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
        )


def _connect(key: str) -> socket.socket | None:
    directory = _private_dir()
    if directory is None:
        return None
    sock_path, _, _ = paths_for(key, directory)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        conn.connect(str(sock_path))
    except OSError:
        conn.close()
        return None
    return conn


def send(conn: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    payload = json.dumps(message).encode()
    if fds:
        socket.send_fds(conn, [payload], list(fds))
    else:
        conn.send(payload)


def receive(conn: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the other side closed the connection."""
    data = conn.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


class _Forwarder:
    """Signal handlers that pass what the client gets on to the child's process group."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.last: int | None = None
        self.previous = {sig: signal.signal(sig, self._forward) for sig in self.SIGNALS}

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.last = signum
        try:
            send(self.conn, {"signal": signum})
        except OSError:
            pass

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _serve_result(conn: socket.socket, log: Path) -> int:
    """Wait for the child's exit status, forwarding signals meanwhile."""
    conn.settimeout(None)  # the command runs as long as it runs: its own deadlines bound it
    forwarder = _Forwarder(conn)
    try:
        while True:
            message = receive(conn)
            if message is None:
                if forwarder.last is not None:
                    return 128 + forwarder.last
                print("kiln: the command's process in Kiln's daemon ended without an exit status "
                      f"(the daemon's log: {log})", file=sys.stderr)
                return 1
            if "status" in message:
                return int(message["status"])
    finally:
        forwarder.restore()


def run(argv: Sequence[str]) -> int | None:
    """Run ``kiln ARGV`` in this machine's daemon; its exit status, or None to run it in-process.

    When there is no daemon for this key, one is started for later commands as this process
    exits: started now, its imports would compete with this command's for the cores.
    """
    cwd = os.getcwd()
    key = daemon_key(os.environ, cwd)
    conn = _connect(key)
    if conn is None:
        atexit.register(spawn, key, cwd)
        return None
    with conn:
        try:
            send(conn, {"key": key, "argv": [sys.argv[0], *argv], "cwd": cwd, "env": dict(os.environ)},
                 fds=(0, 1, 2))
            started = receive(conn)
        except (OSError, ValueError):
            return None
        if not started or "pid" not in started:
            return None  # refused (a stale key, a daemon that is not single-threaded): run here
        return _serve_result(conn, paths_for(key)[2])
