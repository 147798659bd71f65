"""Kiln's build daemon, client side: run a flow command in a process that has Prefect imported already.

Every ``kiln`` command that runs a flow used to pay for starting Python and
importing Prefect and Kiln's flows (1.5-2 s here) before any work: more than
a warm build's own work. Like Gradle's daemon, the first such command starts
one long-lived process in the background (:mod:`kiln.flows.local.daemon_server`)
that imports all of that once and then forks a child per command. The
command itself runs in-process as before (it starts the daemon as it exits,
so the two never compete for the cores); later commands connect to the
daemon, pass it their argv, working directory, environment, umask,
resource limits and stdin, stdout and stderr (``SCM_RIGHTS``), and wait for
the child's exit status. Signals the client gets (Ctrl-C, SIGTERM) are
forwarded to the child's process group; a group still running
``SIGNAL_GRACE_S`` after the first is killed, so the client ends within
half a minute of a signal; if the client dies, the child is terminated.

A daemon serves only commands that would import exactly what it imported:
its key covers the interpreter, the site-packages (their mtimes change on
every install), Kiln's own source files (size, mtime, inode and ctime: an
edit that keeps size and mtime, ``cp -p``, still changes the ctime), the working
directory and the settings Prefect reads at import (``PREFECT_*``, ``HOME``,
``PYTHONPATH``, the profiles file, ``.env`` and ``prefect.toml``), so editing Kiln or switching a profile never runs
stale code: it just gets (and starts) another daemon. Anything unexpected
before the child has started — no daemon, a refused or broken connection —
runs the command in-process instead, so the daemon can only make a command
faster, never make it fail.

The daemon never imports from the command's directory: it runs with ``-P``
(no working directory on ``sys.path``; the key's directory is where Prefect
reads its settings files, as it does for the command), so a ``json.py``
planted in a shared directory is not code it runs. It is started with the
environment its first client had when it began, before that command pointed
``PREFECT_API_URL`` at Kiln's local server, so it computes the key its
clients compute.

``KILN_DAEMON=off`` turns it off; ``KILN_DAEMON_IDLE_SECONDS`` (default 900)
is how long an idle daemon waits before it exits. State lives in
``$TMPDIR/kiln-<uid>/`` (mode 0700; the socket checks the peer's uid too):
``<key>.sock``, ``<key>.lock`` (held by the daemon for its life, so one
daemon per key), ``<key>.log``. A state directory that is not this user's
alone (another user created it first, or its mode lets others in) turns the
daemon off with one warning naming it.

No Prefect import here: this runs before the command's, and must be cheap.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kiln.flows.local.daemon_request import Request, caller_limits

_log = logging.getLogger(__name__)

#: Commands that run a Prefect flow: the ones worth a warm process.
FLOW_COMMANDS = frozenset({"nightly", "release", "build", "test", "bench", "publish"})
#: The environment Prefect and Python read at import time (the rest is handed to the child).
_KEY_ENV_PREFIXES = ("PREFECT_",)
_KEY_ENV_NAMES = ("HOME", "PYTHONPATH", "PYTHONHOME", "TMPDIR")
#: Files in the working directory Prefect reads its settings from at import.
_CWD_SETTINGS_FILES = (".env", "prefect.toml", "pyproject.toml")
_SOURCE_DIRS = ("flows", "tasks", "release", "runtime")
#: Where Kiln's sources are: the _SOURCE_DIRS below it.
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # flows/local/daemon.py -> the checkout
#: The signals a client forwards to its command's process group.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_IDLE_SECONDS = 900.0
#: Largest message either side sends (the request carries the environment).
MAX_MESSAGE = 1 << 20
#: How long the client waits for the daemon to accept and fork (then it runs in-process).
HANDSHAKE_TIMEOUT_S = 10.0
#: How long a forwarded signal has to end the command before the client kills its process group;
#: with KILL_WAIT_S it bounds a signalled client's exit (within 30 s).
SIGNAL_GRACE_S = 20.0
KILL_WAIT_S = 5.0
_POLL_S = 0.5


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get("KILN_DAEMON", "auto").strip().lower() not in ("off", "0", "false", "no")


def state_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kiln-{os.getuid()}"


_warned: set[Path] = set()


def _refusal(path: Path) -> str:
    """Why ``path`` cannot hold this user's daemons ("" if it can), creating it 0700 when missing."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        return f"cannot be created or read ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a link or a file is there)"
    if info.st_uid != os.getuid():
        return f"belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    if info.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(info.st_mode):04o}: others may use it (it must be 0700)"
    return ""


def _private_dir() -> Path | None:
    """The state directory, created 0700; None if it is not ours alone (said once per process)."""
    path = state_dir()
    why = _refusal(path)
    if not why:
        return path
    if path not in _warned:
        _warned.add(path)
        _log.warning("Kiln's daemon is off: its state directory %s %s. Remove it, or point TMPDIR at a "
                     "private directory, to get the daemon back; KILN_DAEMON=off runs every command "
                     "in-process without this warning.", path, why)
    return None


def _source_files(root: Path) -> Iterator[tuple[str, int, int, int, int]]:
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
                    yield entry.path, info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns


def _mtime(path: str | Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _profiles(env: Mapping[str, str]) -> str:
    home = env.get("PREFECT_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".prefect")
    return env.get("PREFECT_PROFILES_PATH") or str(Path(home) / "profiles.toml")


def daemon_key(env: Mapping[str, str], cwd: str, root: Path = SOURCE_ROOT) -> str:
    """What a daemon must share with a command to run it: 16 hex digits."""
    import site

    parts: dict[str, Any] = {
        "python": [os.path.realpath(sys.executable), sys.version, sys.prefix],
        "site": [(p, _mtime(p)) for p in site.getsitepackages()],
        "env": sorted((k, v) for k, v in env.items() if k.startswith(_KEY_ENV_PREFIXES) or k in _KEY_ENV_NAMES),
        "cwd": [cwd, *((name, _mtime(Path(cwd) / name)) for name in _CWD_SETTINGS_FILES)],
        "profiles": _mtime(_profiles(env)),
        "kiln": sorted(_source_files(root)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def paths_for(key: str, directory: Path | None = None) -> tuple[Path, Path, Path]:
    """Socket, lock file and log of the daemon with this key."""
    base = directory or state_dir()
    return base / f"{key}.sock", base / f"{key}.lock", base / f"{key}.log"


def idle_seconds(env: Mapping[str, str] = os.environ) -> tuple[float, str]:
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


def daemon_command_line(key: str, entry: str | None = None) -> list[str]:
    """How a daemon is started: ``-P`` keeps the working directory off its import path."""
    return [sys.executable, "-P", "-m", "kiln.flows.local.daemon_server", key, *([entry] if entry else [])]


def spawn(key: str, cwd: str, env: Mapping[str, str]) -> None:
    """Start a daemon for ``key`` in the background (it exits at once if one already holds the key's lock).

    ``env`` and ``cwd`` are the ones the key was computed from: the caller's, as its command began.
    """
    directory = _private_dir()
    if directory is None:
        return
    _, _, log = paths_for(key, directory)
    with open(log, "ab") as out:
        # A service, not a step: it ends itself after KILN_DAEMON_IDLE_SECONDS without a command.
        subprocess.Popen(
            daemon_command_line(key), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
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
    """The next message, or None when the other side closed the connection.

    Raises ``ValueError`` for anything but a JSON object.
    """
    data = conn.recv(MAX_MESSAGE)
    if not data:
        return None
    try:
        message = json.loads(data)
    except RecursionError as exc:
        raise ValueError("a message nested too deeply") from exc
    if not isinstance(message, dict):
        raise ValueError(f"a message that is not a JSON object: {data[:80]!r}")
    return message


class _Forwarder:
    """Signal handlers that pass what the client gets on to the child's process group.

    A group still running ``SIGNAL_GRACE_S`` after the first signal is killed (the child set
    its own group: its pid is the group's id), and the client stops waiting ``KILL_WAIT_S`` later.
    """

    def __init__(self, conn: socket.socket, pgid: int) -> None:
        self.conn, self.pgid = conn, pgid
        self.last: int | None = None
        self.first_at: float | None = None
        self.killed_at: float | None = None
        self.previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED_SIGNALS}

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.last = signum
        if self.first_at is None:
            self.first_at = time.monotonic()
        try:
            send(self.conn, {"signal": signum})
        except OSError:
            pass  # the child is gone or going: the wait below sees the connection close

    def overdue(self) -> bool:
        """Kill the group once the grace is over; whether the client should stop waiting."""
        if self.first_at is None:
            return False
        now = time.monotonic()
        if self.killed_at is None and now - self.first_at >= SIGNAL_GRACE_S:
            print(f"kiln: the command did not end within {SIGNAL_GRACE_S:g} s of signal {self.last}: "
                  f"killing its process group {self.pgid}", file=sys.stderr)
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended meanwhile
            self.killed_at = now
        return self.killed_at is not None and now - self.killed_at >= KILL_WAIT_S

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _serve_result(conn: socket.socket, pgid: int, log: Path) -> int:
    """Wait for the child's exit status, forwarding signals meanwhile."""
    conn.settimeout(_POLL_S)  # the command runs as long as it runs (its own deadlines bound it), unless signalled
    forwarder = _Forwarder(conn, pgid)
    try:
        while True:
            try:
                message = receive(conn)
            except TimeoutError:
                if forwarder.overdue():
                    return 128 + (forwarder.last or signal.SIGTERM)
                continue
            except (OSError, ValueError):
                message = None
            if message is None:
                if forwarder.last is not None:
                    return 128 + forwarder.last
                print("kiln: the command's process in Kiln's daemon ended without an exit status "
                      f"(the daemon's log: {log})", file=sys.stderr)
                return 1
            status = message.get("status")
            if isinstance(status, int) and not isinstance(status, bool):
                return status
    finally:
        forwarder.restore()


def run(argv: Sequence[str]) -> int | None:
    """Run ``kiln ARGV`` in this machine's daemon; its exit status, or None to run it in-process.

    When there is no daemon for this key, one is started for later commands as this process
    exits: started now, its imports would compete with this command's for the cores. It gets
    this command's environment as it is now, before the command changes it (``PREFECT_API_URL``
    for Kiln's local server): the environment the key was computed from.
    """
    cwd, env = os.getcwd(), dict(os.environ)
    key = daemon_key(env, cwd)
    conn = _connect(key)
    if conn is None:
        atexit.register(spawn, key, cwd, env)
        return None
    umask, limits = caller_limits()
    request = Request(key=key, argv=(sys.argv[0], *argv), cwd=cwd, env=env, umask=umask, rlimits=limits)
    with conn:
        try:
            send(conn, request.to_json(), fds=(0, 1, 2))
            started = receive(conn)
        except (OSError, ValueError):
            return None
        pid = started.get("pid") if started else None
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            return None  # refused (a stale key, limits it cannot give, a daemon not single-threaded): run here
        return _serve_result(conn, pid, paths_for(key)[2])
