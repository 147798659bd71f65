"""Kiln's build daemon, server side: import Prefect and Kiln's flows once, fork a child per command.

Started in the background by the first flow command that finds no daemon for
its key (:mod:`kiln.flows.local.daemon`)::

    python -P -m kiln.flows.local.daemon_server KEY [MODULE:FUNCTION]

``-P`` keeps the directory it starts in off ``sys.path`` (it refuses to
start without it). It checks that its own key is ``KEY`` (the same interpreter, sources,
directory and environment as the command that started it), takes the key's
lock (a second daemon for the key exits at once), imports the flows, and
only then binds its socket, so a command that connects always finds a warm
process. It forks only while it has a single thread, which it checks before
every fork; it never runs a flow itself.

A request is parsed once (:mod:`kiln.flows.local.daemon_request`); a malformed
one is refused and the daemon goes on serving. Each child becomes the
command: its own process group, the client's umask, resource limits, stdio,
working directory, environment and argv (limits or a directory it cannot
take are refused before the client's stdio is touched, and the client runs
the command in-process), Prefect's logging handlers
rebuilt on the client's stderr. It runs ``FUNCTION(argv)`` (the ``kiln``
command line by default), ends as the interpreter would (Prefect's log and
event workers drained, atexit handlers run, output flushed), and sends the
exit status last. A thread relays the client's forwarded signals to the
child's process group and terminates it if the client goes away.

The daemon exits after ``KILN_DAEMON_IDLE_SECONDS`` without a command and
no child running, or on SIGTERM (``kiln daemon stop``); running children
finish their commands.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import fcntl
import gc
import importlib
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from kiln.core import identity
from kiln.core.sandbox import seal_environ
from kiln.flows.local import daemon
from kiln.flows.local.daemon_request import BadRequest, Request, parse_request
from kiln.flows.local.environment import apply_defaults

Entry = Callable[[list[str]], int]
DEFAULT_ENTRY = "kiln.flows.cli:main"
#: What every flow command imports: loaded once, before the socket exists.
WARM_MODULES = (
    "kiln.flows.cli", "kiln.flows.nightly", "kiln.flows.release", "kiln.flows.build", "kiln.flows.test",
    "kiln.flows.bench", "kiln.flows.publish",
)
#: What a flow run imports on first use (Prefect's engines, the server's API models, their helpers):
#: 0.3 s of every command if each child imported them again. Any that is missing is skipped.
WARM_LAZY_MODULES = (
    "prefect.flow_engine", "prefect.task_engine", "prefect.engine", "prefect.utilities.visualization",
    "prefect._internal.control_listener", "prefect._internal.attempt_control", "prefect._internal.metrics",
    "prefect._internal.states", "prefect.concurrency.v1.context", "fastapi", "anyio._backends._asyncio",
    "opentelemetry.metrics", "opentelemetry._logs", "pydantic.color", "rich._emoji_codes", "http.cookies",
    "encodings.idna", "kiln.flows.local.server",
)
_POLL_S = 2.0


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kiln daemon {os.getpid()}: {message}", file=sys.stderr,
          flush=True)


def _load(entry: str) -> Entry:
    module, _, name = entry.partition(":")
    for warm in WARM_MODULES:
        importlib.import_module(warm)
    for lazy in WARM_LAZY_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(lazy)
    func: Entry = getattr(importlib.import_module(module), name)
    _complete_models()
    return func


def _complete_models() -> None:
    """Build the validators pydantic defers to a model's first use (Prefect's client and event models).

    Each child would otherwise build the same ones again when it creates its flow run, its events and
    its artifacts: 5 % of a warm build. 0.1 s, once, here.
    """
    from pydantic import BaseModel

    seen: set[type] = set()
    stack: list[type[BaseModel]] = [BaseModel]
    while stack:
        for model in stack.pop().__subclasses__():
            if model in seen:
                continue
            seen.add(model)
            stack.append(model)
            if getattr(model, "__pydantic_complete__", True) is False:
                with contextlib.suppress(Exception):  # one it cannot build yet is built on first use, as before
                    model.model_rebuild()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives; a message is printed the way the interpreter prints it."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _relay(conn: socket.socket, finished: threading.Event) -> None:
    """The child's signal relay: forwarded signals go to its process group; a vanished client ends it."""
    while True:
        try:
            message = daemon.receive(conn)
        except (OSError, ValueError):
            message = None
        if message is None:
            if not finished.is_set():
                os.killpg(0, signal.SIGTERM)
            return
        if message.get("signal") in daemon.FORWARDED_SIGNALS:
            os.killpg(0, int(message["signal"]))


class LimitsError(Exception):
    """The child cannot take its client's umask, resource limits or directory: the client runs the command."""


def _take_limits(request: Request) -> None:
    """The client's umask, resource limits (soft and hard) and working directory, before anything runs."""
    os.umask(request.umask)
    for name, wanted in request.rlimits.items():
        which = getattr(resource, name)
        if resource.getrlimit(which) == wanted:
            continue
        try:
            resource.setrlimit(which, wanted)
        except (ValueError, OSError) as exc:
            raise LimitsError(f"cannot set {name} to {wanted} (the daemon's is {resource.getrlimit(which)}): "
                              f"{exc}") from exc
    try:
        os.chdir(request.cwd)
    except OSError as exc:
        raise LimitsError(f"cannot enter {request.cwd}: {exc.strerror}") from exc


def _become(request: Request, fds: Sequence[int]) -> None:
    """Turn this forked child into the client's process: stdio, environment, argv, log handlers."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    seal_environ()  # the client's environment (its credentials) arrives next: unreadable through /proc
    os.environ.clear()
    os.environ.update(request.env)
    identity.hold()  # the client's CI identity, as the kiln command itself would hold it
    sys.argv = list(request.argv)
    encoding = sys.stdout.encoding
    sys.stdin = open(0, encoding=encoding, closefd=False)
    sys.stdout = open(1, "w", encoding=encoding, closefd=False, buffering=1 if os.isatty(1) else -1)
    sys.stderr = open(2, "w", encoding=encoding, errors="backslashreplace", buffering=1,
                      closefd=False)
    # Prefect's settings need no refresh: the key made sure they were read from the same
    # PREFECT_* variables, profile and settings files. Its console handlers do: they hold a stream.
    _console_to_stderr()


def _console_to_stderr() -> None:
    """Point Prefect's console log handlers at this process's stderr, colours detected anew.

    A copy of each handler's rich console with the new file (the daemon's was its log file):
    1 ms where Prefect's ``setup_logging`` takes 70 ms, which is the fallback.
    """
    from prefect.logging.configuration import setup_logging
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict))]
    handlers = {id(h): h for lg in loggers for h in getattr(lg, "handlers", ()) if isinstance(h, PrefectConsoleHandler)}
    try:
        for handler in handlers.values():
            console = copy.copy(handler.console)
            console.file = sys.stderr
            console._color_system = console._detect_color_system()
            handler.setStream(sys.stderr)
            handler.console = console
    except AttributeError:  # another rich: let Prefect build its handlers again
        setup_logging(incremental=False)


def _child(conn: socket.socket, request: Request, fds: Sequence[int], entry: Entry) -> NoReturn:
    status, finished = 1, threading.Event()
    os.setpgid(0, 0)  # before the client learns the pid: it is the group the client may have to kill
    try:
        _take_limits(request)
    except LimitsError as exc:  # still on the daemon's log: nothing of the client's is in place yet
        _log(f"command pid {os.getpid()} refused: {exc}")
        daemon.send(conn, {"error": str(exc)})
        os._exit(1)
    try:
        _become(request, fds)
        daemon.send(conn, {"pid": os.getpid()})
        threading.Thread(target=_relay, args=(conn, finished), name="kiln-daemon-relay", daemon=True).start()
        status = entry(list(request.argv[1:]))
    except SystemExit as exc:
        status = _exit_code(exc)
    except KeyboardInterrupt:
        status = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        finished.set()
        daemon.send(conn, {"status": status})
    finally:
        os._exit(status)


class Daemon:
    def __init__(self, key: str, entry: Entry, listener: socket.socket, lock_fd: int) -> None:
        self.key, self.entry, self.listener, self.lock_fd = key, entry, listener, lock_fd
        self.children: set[int] = set()
        self.idle_s, problem = daemon.idle_seconds()
        if problem:
            _log(problem)

    def _reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.children.discard(pid)
                _log(f"command pid {pid} ended (exit {os.waitstatus_to_exitcode(status)})")

    def _refuse(self, conn: socket.socket, why: str) -> None:
        _log(f"refused a command: {why}")
        daemon.send(conn, {"error": why})

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(daemon.HANDSHAKE_TIMEOUT_S)
        if _peer_uid(conn) != os.getuid():
            _log("refused a connection from another user")
            return
        data, fds, _, _ = socket.recv_fds(conn, daemon.MAX_MESSAGE, 3)
        try:
            self._start(conn, data, fds)
        finally:  # the child has its own copies; a refused request's are closed here
            for fd in fds:
                os.close(fd)

    def _start(self, conn: socket.socket, data: bytes, fds: Sequence[int]) -> None:
        try:
            request = parse_request(data)
        except BadRequest as exc:
            return self._refuse(conn, f"a malformed request: {exc}")
        if len(fds) != 3 or request.key != self.key:
            return self._refuse(conn, "not a request for this daemon's key (with stdin, stdout and stderr)")
        if threading.active_count() != 1:
            return self._refuse(conn, f"{threading.active_count()} threads: not safe to fork")
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            os.close(self.lock_fd)  # the lock is the daemon's alone: a child must not keep it alive
            conn.settimeout(None)
            try:
                _child(conn, request, fds, self.entry)
            finally:  # whatever escapes the child (the daemon's SIGTERM handler before its own): never serve
                os._exit(1)
        self.children.add(pid)
        _log(f"command pid {pid}: {' '.join(['kiln', *request.argv[1:]])} (in {request.cwd})")

    def serve(self) -> None:
        last = time.monotonic()
        self.listener.settimeout(min(_POLL_S, self.idle_s))
        while True:
            self._reap()
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                if not self.children and time.monotonic() - last > self.idle_s:
                    _log(f"idle for {self.idle_s:.0f} s: exiting")
                    return
                continue
            last = time.monotonic()
            with conn:
                try:
                    self._handle(conn)
                except (OSError, ValueError) as exc:
                    _log(f"a command's handshake failed: {exc!r}")


def _bind(sock_path: Path) -> socket.socket:
    """Listen on ``sock_path``, replacing a dead daemon's socket; the path appears only once listening."""
    tmp = sock_path.with_name(f"{sock_path.stem}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp))
    listener.listen(16)
    os.replace(tmp, sock_path)
    return listener


def _stop(signum: int, _frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    key, entry_name = args[0], (args[1] if len(args) > 1 else DEFAULT_ENTRY)
    if not sys.flags.safe_path:  # its directory would be on sys.path: a planted json.py would run here
        _log(f"not starting for key {key}: started without -P (see kiln.flows.local.daemon.daemon_command_line)")
        return 1
    apply_defaults()  # as the `kiln` script does before its key: the flows' import would apply them anyway
    directory, mine = daemon._private_dir(), daemon.daemon_key(os.environ, os.getcwd())
    if directory is None or mine != key:
        _log(f"not starting for key {key}: this process's key is {mine}, its state directory "
             f"{directory or 'not private'}")
        return 1
    sock_path, lock_path, _ = daemon.paths_for(key, directory)
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another daemon has this key
    os.ftruncate(lock_fd, 0)
    os.write(lock_fd, f"{os.getpid()}\n".encode())
    started = time.monotonic()
    entry = _load(entry_name)
    if daemon.daemon_key(os.environ, os.getcwd()) != key:  # a source file changed while importing
        _log("Kiln's sources changed while the daemon imported them: exiting")
        return 1
    signal.signal(signal.SIGTERM, _stop)
    # Everything imported so far stays: out of the collector's sight, so a child's collections do
    # not touch (and copy) every page it shares with the daemon.
    gc.collect()
    gc.freeze()
    listener = _bind(sock_path)
    _log(f"serving {key} on {sock_path} (imports took {time.monotonic() - started:.2f} s)")
    try:
        Daemon(key, entry, listener, lock_fd).serve()
    finally:  # the key's lock is still held: no other daemon can have bound this path
        sock_path.unlink(missing_ok=True)
        listener.close()
    return 0


def running(directory: Path | None = None) -> list[tuple[str, int]]:
    """``(key, pid)`` of every live daemon of this user (their lock is held)."""
    found = []
    for lock in sorted((directory or daemon.state_dir()).glob("*.lock")):
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = lock.read_text().strip()
            if text.isdigit():
                found.append((lock.stem, int(text)))
        finally:
            os.close(fd)
    return found


def daemon_command(action: str) -> int:
    """``kiln daemon status|stop``: list this user's daemons, or stop each (SIGTERM, SIGKILL after a grace)."""
    from kiln.flows.local.server import stop_pid

    found = running()
    if not found:
        print(f"no Kiln daemon is running (state: {daemon.state_dir()})")
        return 0 if action == "stop" else 1
    for key, pid in found:
        if action == "stop":
            stop_pid(pid)  # its group is the daemon alone: running commands have groups of their own
            print(f"stopped the Kiln daemon pid {pid} (key {key})")
        else:
            print(f"running: pid {pid}, key {key}, log {daemon.paths_for(key)[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
