"""The build stage's compile pool: spawned worker processes with per-call deadlines.

Compile units are short (a fraction of a second each) but importing Triton
and a kernel package costs seconds, so workers are started once and reused.
The parent owns every deadline: a call that runs past its timeout gets the
ladder of :mod:`kiln.tasks.process` (stack dump → SIGTERM to the worker's
process group → grace → SIGKILL → reap; the worker leads its own group, so
compiler subprocesses such as ``ptxas`` die with it), and the worker is
replaced. Workers use the ``spawn`` start method: no forked copy of a
parent's threads, locks or GPU state.

An exception raised in a worker comes back as itself — pickled, with the
worker's formatted traceback — and is re-raised in the parent from a
:class:`RemoteTraceback` holding that text (as ``concurrent.futures`` does).
A :class:`~kiln.release.errors.KilnError` keeps its type; anything else is an
error of the worker, not of the code it was asked to judge, and becomes a
:class:`~kiln.release.errors.BuildWorkerError` raised from it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from kiln.release.errors import BuildWorkerError, InfrastructureError, KilnError
from kiln.tasks.process import Escalation, LadderResult, install_stack_dump, kill_group, terminate

_log = logging.getLogger("kiln.build.pool")

_TERM_GRACE_S = 2.0
_START_TIMEOUT_S = 120.0  # interpreter start and the pool's own imports, on a loaded machine
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
    except Exception:  # noqa: BLE001 — any failure to pickle means: send the stand-in instead
        data = pickle.dumps(UnpicklableRemoteError(_qualname(exc), str(exc)))
    return data, tb


def unpack_error(data: bytes, tb: str) -> BaseException:
    """The worker's exception, with its traceback attached as ``__cause__``."""
    try:
        exc = pickle.loads(data)
    except Exception as load_error:  # noqa: BLE001 — e.g. its class is not importable in the parent
        exc = UnpicklableRemoteError("unknown", f"could not load the worker's exception: {load_error}")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _serve(conn: Connection, env: dict[str, str | None], stacks: str) -> None:
    """Worker main loop: receive ``(target, request)``, send back a result."""
    os.setpgrp()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    dump = install_stack_dump(stacks)  # noqa: F841 — must stay open for the life of the worker
    conn.send(("ready", os.getpid()))  # only now does killpg(pid) reach the worker's whole group
    while True:
        try:
            target, request = conn.recv()
        except EOFError:
            return
        module, _, attr = target.partition(":")
        try:
            result = ("ok", getattr(importlib.import_module(module), attr)(request))
        except Exception as exc:  # sent to the parent, which re-raises it as its own type
            result = ("error", pack_error(exc))
        conn.send(result)


class _WorkerChild:
    """Adapts a multiprocessing.Process to kiln.tasks.process's Child protocol."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid or 0

    def wait(self, timeout: float) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


@dataclass
class _Worker:
    process: Any
    conn: Connection
    stacks: Path


class WorkerPool:
    """``size`` reusable workers; :meth:`call` is thread-safe and blocks for a free one."""

    def __init__(self, size: int, env: dict[str, str | None] | None = None) -> None:
        self.size = size
        self.env = dict(env or {})
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._closed = False
        self._dumps = Path(tempfile.mkdtemp(prefix="kiln-pool-"))
        self._seq = 0

    def _start(self) -> _Worker:
        context = multiprocessing.get_context("spawn")
        with self._lock:
            self._seq += 1
            stacks = self._dumps / f"worker-{self._seq}.stacks"
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self.env, str(stacks)), daemon=True, name="kiln-worker")
        process.start()
        child.close()
        worker = _Worker(process, parent, stacks)
        try:
            ready = parent.poll(_START_TIMEOUT_S) and parent.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            # Not yet (or never) the leader of its own group: end the process itself.
            process.kill()
            process.join(_TERM_GRACE_S)
            parent.close()
            raise InfrastructureError(f"build worker pid {process.pid} did not start within {_START_TIMEOUT_S:g} s"
                                      f" (exit status {process.exitcode})")
        with self._lock:
            self._all.append(worker)
        _log.debug("started worker pid %s", process.pid)
        return worker

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise InfrastructureError("worker pool is closed")
            grow = self._started < self.size
            if grow:
                self._started += 1
        if not grow:
            return self._idle.get()
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
            crash = worker.stacks.read_text(errors="replace")[-2000:] if worker.stacks.exists() else ""
            raise InfrastructureError(f"build worker pid {pid} died during {target}: {exc}"
                                      + (f"\n{crash}" if crash else "")) from exc
        except BaseException:
            self._retire(worker)
            raise
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
            return LadderResult(worker.process.exitcode, False, "exited")
        child = _WorkerChild(worker.process)
        if worker.process.is_alive():
            result = terminate(child, _TERM_GRACE_S, worker.stacks, dump=dump)
        else:
            kill_group(child.pid)  # a compiler subprocess may outlive its worker
            result = LadderResult(worker.process.exitcode, False, "exited")
        worker.conn.close()
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            worker.conn.close()  # the worker's recv() gets EOF and returns
        for worker in workers:
            worker.process.join(_TERM_GRACE_S)
            self._retire(worker, dump=False)
        shutil.rmtree(self._dumps, ignore_errors=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
