"""The build stage's compile pool: spawned worker processes with per-call deadlines.

Compile units are short (a fraction of a second each) but importing Triton
and a kernel package costs seconds, so workers are started once and reused.
The parent owns every deadline: a call that runs past its timeout gets the
ladder of :mod:`kiln.tasks.process` (stack dump → SIGTERM to the worker's
process group → grace → SIGKILL → reap; the worker leads its own group, so
compiler subprocesses such as ``ptxas`` die with it), and the worker is
replaced. Workers are fresh interpreters (``python -P -m
kiln.tasks.build.pool_worker``): no forked copy of a parent's threads, locks
or GPU state, and never the working directory on their import path (a module
planted where a kiln command runs is not imported); each leads its own
process group and takes the parent's import path over its connection.

An exception raised in a worker comes back as itself — pickled, with the
worker's formatted traceback — and is re-raised in the parent from a
:class:`RemoteTraceback` holding that text (as ``concurrent.futures`` does).
A :class:`~kiln.core.errors.KilnError` keeps its type; anything else is an
error of the worker, not of the code it was asked to judge, and becomes a
:class:`~kiln.core.errors.BuildWorkerError` raised from it.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn, cast

from kiln.core.entrypoints import load
from kiln.core.errors import BuildWorkerError, InfrastructureError, KilnError
from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.process import (
    Escalation,
    LadderResult,
    PopenChild,
    cancel_requested,
    check_cancelled,
    install_stack_dump,
    kill_group,
    register,
    terminate,
    unregister,
)

_log = logging.getLogger(__name__)

WORKER_MODULE = "kiln.tasks.build.pool_worker"

_TERM_GRACE_S = 2.0
_START_TIMEOUT_S = 120.0  # interpreter start and the pool's own imports, on a loaded machine
_IDLE_POLL_S = 0.25  # how often a call waiting for a busy pool looks at cancellation and free slots
_ENDED_BY: dict[Escalation, str] = {
    "exited": "had already exited",
    "sigterm": "process group ended by SIGTERM",
    "sigkill": "process group ended by SIGKILL after the grace period",
    "unreaped": "process group sent SIGKILL but the worker could not be reaped",
}


class WorkerTimeout(KilnError):
    """A call ran past its deadline; the worker went down the ladder (see :attr:`escalation`)."""

    def __init__(self, message: str, escalation: Escalation, stacks: str) -> None:
        super().__init__(message)
        self.escalation, self.stacks = escalation, stacks

    @property
    def ladder(self) -> str:
        """How the worker ended, in words: ``"stacks dumped, process group ended by SIGTERM"``."""
        return describe_ladder(self.escalation, self.stacks)

    def __reduce__(self) -> tuple[type, tuple[str, Escalation, str]]:
        return type(self), (str(self), self.escalation, self.stacks)


def describe_ladder(escalation: Escalation, stacks: str) -> str:
    return ("stacks dumped, " if stacks else "no stacks dumped, ") + _ENDED_BY[escalation]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker; the cause of the error re-raised here."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class UnpicklableRemoteError(Exception):
    """Stands in for a worker's exception that could not be pickled: its type's qualified name and message."""

    def __init__(self, qualname: str, message: str) -> None:
        super().__init__(f"{qualname}: {message}")
        self.qualname, self.message = qualname, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.qualname, self.message)


def _qualname(exc: BaseException) -> str:
    """``ModuleNotFoundError``, ``triton.compiler.errors.CompilationError``: the type as code would name it."""
    module = type(exc).__module__
    return type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"


def pack_error(exc: BaseException) -> tuple[bytes, str]:
    """``(pickled exception, formatted traceback)``; the stand-in when ``exc`` does not survive a round trip."""
    tb = "".join(traceback.format_exception(exc))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # an exception whose __init__ wants more than its args pickles but cannot load
    except Exception:
        data = pickle.dumps(UnpicklableRemoteError(_qualname(exc), str(exc)))
    return data, tb


def unpack_error(data: bytes, tb: str) -> BaseException:
    """The worker's exception, with its traceback attached as ``__cause__``."""
    try:
        exc: BaseException = pickle.loads(data)
    except Exception as load_error:
        exc = UnpicklableRemoteError("unknown", f"could not load the worker's exception: {load_error}")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def serve(conn: Connection, stacks: str) -> None:
    """Worker main loop: take the parent's import path, then receive ``(target, request)``, send back a result."""
    sys.path[:] = [p for p in conn.recv() if os.path.isabs(p)]  # "" or "." would be the working directory
    dump = install_stack_dump(stacks)  # noqa: F841 — must stay open for the life of the worker
    conn.send(("ready", os.getpid()))
    while True:
        try:
            target, request = conn.recv()
        except EOFError:
            return
        try:
            result = ("ok", cast(Callable[[Any], Any], load(target))(request))
        except Exception as exc:  # sent to the parent, which re-raises it as its own type
            result = ("error", pack_error(exc))
        conn.send(result)


def worker_environ(overrides: Mapping[str, str | None], base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``overrides`` applied: a value sets the variable, ``None`` removes it."""
    environ = dict(base)
    for name, value in overrides.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


@dataclass
class _Worker:
    process: subprocess.Popen[bytes]
    conn: Connection
    stacks: Path
    child: PopenChild
    busy: bool = False  # checked out by a call: only that call's thread may close its connection


class WorkerPool:
    """``size`` reusable workers; :meth:`call` is thread-safe and blocks for a free one."""

    def __init__(self, size: int, env: dict[str, str | None] | None = None, read: tuple[str, ...] = (),
                 write: tuple[str, ...] = ()) -> None:
        self.size = size
        self.env = dict(env or {})
        # the workers import the package's registry: sandboxed, reading ``read`` and writing ``write`` beside
        # their own stack dumps and home, with no network
        self.read, self.write = read, write
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._closed = False
        self._dumps = Path(tempfile.mkdtemp(prefix="kiln-pool-"))
        self._seq = 0

    def _start(self) -> _Worker:
        with self._lock:
            self._seq += 1
            stacks = self._dumps / f"worker-{self._seq}.stacks"
        ours, theirs = socket.socketpair()
        try:
            # -P: the directory this command runs in is never on the worker's import path.
            cmd = [sys.executable, "-P", "-m", WORKER_MODULE, str(theirs.fileno()), str(stacks)]
            home = self._dumps / f"home-{self._seq}"
            process = subprocess.Popen(guest_command(cmd, read=self.read, write=(*self.write, self._dumps),
                                                     network="none"),
                                       pass_fds=(theirs.fileno(),),
                                       env=guest_environ(home, base=worker_environ(self.env, os.environ)),
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        parent = Connection(ours.detach())
        worker = _Worker(process, parent, stacks, PopenChild(process), busy=True)
        # It leads its group from its first instant, so a cancellation ends it even while it starts; without
        # a stack dump until it is ready: before its handler is installed, the dump signal would kill it.
        self._register(worker, None)
        try:
            parent.send(list(sys.path))
            ready = parent.poll(_START_TIMEOUT_S) and parent.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            unregister(worker.child)
            ended = terminate(worker.child, _TERM_GRACE_S, dump=False)
            parent.close()
            check_cancelled(f"build worker pid {process.pid}")  # ended by a cancellation: not a lost worker
            raise InfrastructureError(f"build worker pid {process.pid} did not start within {_START_TIMEOUT_S:g} s"
                                      f" (exit status {ended.returncode})")
        self._register(worker, stacks)
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.append(worker)
        if closed:  # close() did not see it: end it here
            unregister(worker.child)
            terminate(worker.child, _TERM_GRACE_S, dump=False)
            parent.close()
            raise InfrastructureError("worker pool is closed")
        _log.debug("started worker pid %s", process.pid)
        return worker

    @staticmethod
    def _register(worker: _Worker, stacks: Path | None) -> None:
        """Track the worker's group for a cancellation (again: with its stack dump once it is ready)."""
        try:
            register(worker.child, stacks, _TERM_GRACE_S)
        except BaseException:
            worker.conn.close()  # register ended the group: the run is being cancelled
            raise

    def _checkout(self) -> _Worker:
        """An idle worker, or a new one while the pool is below its size.

        Waits in short slices: a worker retired by a deadline frees its slot
        without anyone putting a worker back, and a cancellation must stop the wait.
        """
        while True:
            check_cancelled("a build worker call")
            with self._lock:
                if self._closed:
                    raise InfrastructureError("worker pool is closed")
                grow = self._started < self.size
                if grow:
                    self._started += 1
            if grow:
                break
            try:
                worker = self._idle.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
            with self._lock:  # close() decides under this lock which connections it may close
                if self._closed:
                    raise InfrastructureError("worker pool is closed")
                worker.busy = True
            return worker
        try:
            return self._start()
        except BaseException:
            with self._lock:
                self._started -= 1
            raise

    def _discard(self, worker: _Worker) -> bool:
        with self._lock:
            if worker not in self._all:
                return False
            self._all.remove(worker)
            self._started -= 1
            return True

    # Any: whatever the worker function takes, sent through pickle
    def call(self, target: str, request: Any, timeout: float) -> Any:
        """Run ``module:function(request)`` in a worker; its return value or a raised error.

        A :class:`KilnError` raised by the function comes back as itself, from a
        :class:`RemoteTraceback`; any other exception becomes a
        :class:`BuildWorkerError` raised from it. A worker that dies raises the
        retryable :class:`InfrastructureError`; a deadline raises :class:`WorkerTimeout`.
        """
        worker = self._checkout()
        pid = worker.process.pid
        try:
            worker.conn.send((target, request))
            if not worker.conn.poll(timeout):
                self._time_out(worker, target, timeout)
            status, value = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._retire(worker, dump=False)  # it is gone or going: nothing left to ask for stacks
            if cancel_requested():  # ended by the cancellation, not lost: nothing to retry
                check_cancelled(f"{target} (worker pid {pid} was ended)")
            crash = worker.stacks.read_text(errors="replace")[-2000:] if worker.stacks.exists() else ""
            raise InfrastructureError(f"build worker pid {pid} died during {target}: {exc}"
                                      + (f"\n{crash}" if crash else "")) from exc
        except BaseException:
            self._retire(worker)
            raise
        worker.busy = False
        self._idle.put(worker)
        if status == "error":
            self._reraise(unpack_error(*value), pid, target)
        return value

    def _time_out(self, worker: _Worker, target: str, timeout: float) -> NoReturn:
        pid = worker.process.pid
        result = self._retire(worker)
        ended = describe_ladder(result.escalation, result.stacks)
        _log.warning("worker pid %s: %s ran past its %g s deadline; %s\n%s", pid, target, timeout, ended, result.stacks)
        raise WorkerTimeout(f"{target} ran past its {timeout:g} s deadline; worker pid {pid}: {ended}",
                            result.escalation, result.stacks)

    @staticmethod
    def _reraise(exc: BaseException, pid: int | None, target: str) -> NoReturn:
        if isinstance(exc, KilnError):
            raise exc
        name = exc.qualname if isinstance(exc, UnpicklableRemoteError) else _qualname(exc)
        detail = exc.message if isinstance(exc, UnpicklableRemoteError) else str(exc)
        raise BuildWorkerError(f"pid {pid}", target, name, detail) from exc

    def _retire(self, worker: _Worker, dump: bool = True) -> LadderResult:
        """Take ``worker`` out of the pool and end its process group through the shared ladder."""
        if not self._discard(worker):
            return LadderResult(worker.process.poll(), False, "exited")
        child = worker.child
        unregister(child)
        if worker.process.poll() is None:
            result = terminate(child, _TERM_GRACE_S, worker.stacks, dump=dump)
        else:
            kill_group(child.pid)  # a compiler subprocess may outlive its worker
            result = LadderResult(worker.process.returncode, False, "exited")
        worker.conn.close()
        return result

    def close(self) -> None:
        """Stop every worker: an idle one by closing its connection, a busy one with the ladder.

        A busy worker's connection is left to the thread of its call, which
        sees EOF and retires it: closing it here, under that thread's poll, lets
        the descriptor's number be reused by another file, and the poll then
        waits on that file until the call's deadline (a cancelled build hung so).
        """
        with self._lock:
            self._closed = True
            idle = [w for w in self._all if not w.busy]
            busy = [w for w in self._all if w.busy]
        for worker in idle:
            worker.conn.close()  # the worker's recv() gets EOF and returns
        for worker in busy:
            if worker.process.poll() is None:
                terminate(worker.child, _TERM_GRACE_S, worker.stacks, dump=False)
        for worker in idle:
            worker.child.wait(_TERM_GRACE_S)
            self._retire(worker, dump=False)
        shutil.rmtree(self._dumps, ignore_errors=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
