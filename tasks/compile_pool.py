"""The build stage's compile pool: spawned worker processes with per-call deadlines.

Compile units are short (a fraction of a second each) but importing Triton
and a kernel package costs seconds, so workers are started once and reused.
The parent owns every deadline: a call that runs past its timeout gets the
dump → terminate → kill ladder on the worker's whole process group (the
worker leads its own group, so compiler subprocesses such as ``ptxas`` die
with it), and the worker is replaced. Workers use the ``spawn`` start method:
no forked copy of a parent's threads, locks or GPU state.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from release.errors import InfrastructureError, KilnError

_log = logging.getLogger("kiln.build.pool")

_DUMP_GRACE_S = 1.0
_TERM_GRACE_S = 2.0


class WorkerTimeout(KilnError):
    """A call ran past its deadline; the worker was killed (see :attr:`ladder`)."""

    def __init__(self, message: str, ladder: str) -> None:
        super().__init__(message)
        self.ladder = ladder


def _serve(conn: Connection, env: dict[str, str | None]) -> None:
    """Worker main loop: receive ``(target, request)``, send back a result."""
    import faulthandler

    os.setpgrp()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    while True:
        try:
            target, request = conn.recv()
        except EOFError:
            return
        module, _, attr = target.partition(":")
        try:
            result = ("ok", getattr(importlib.import_module(module), attr)(request))
        except Exception as exc:  # reported to the parent, which raises a typed error
            result = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(result)


@dataclass
class _Worker:
    process: Any
    conn: Connection


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

    def _start(self) -> _Worker:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self.env), daemon=True, name="kiln-worker")
        process.start()
        child.close()
        worker = _Worker(process, parent)
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
        return self._start() if grow else self._idle.get()

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            self._started -= 1

    def call(self, target: str, request: Any, timeout: float) -> Any:
        """Run ``module:function(request)`` in a worker; its return value or a raised error.

        Errors inside the function come back as ``RuntimeError`` with the
        worker's message; a worker that dies raises the retryable
        :class:`InfrastructureError`; a deadline raises :class:`WorkerTimeout`.
        """
        worker = self._checkout()
        try:
            worker.conn.send((target, request))
            if not worker.conn.poll(timeout):
                ladder = self._kill(worker)
                raise WorkerTimeout(f"{target} ran past its {timeout:g} s deadline; worker {ladder}", ladder)
            status, value = worker.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self._kill(worker)
            raise InfrastructureError(f"build worker pid {worker.process.pid} died during {target}: {exc}") from exc
        except BaseException:
            if worker.process.is_alive() and worker in self._all:
                self._kill(worker)
            raise
        self._idle.put(worker)
        if status == "error":
            raise RuntimeError(value)
        return value

    def _kill(self, worker: _Worker) -> str:
        """Dump stacks, then SIGTERM, then SIGKILL the worker's process group."""
        pid = worker.process.pid
        self._discard(worker)
        steps = []
        for sig, grace, name in ((signal.SIGUSR1, _DUMP_GRACE_S, "stacks dumped"),
                                 (signal.SIGTERM, _TERM_GRACE_S, "terminated"),
                                 (signal.SIGKILL, _TERM_GRACE_S, "killed")):
            if not worker.process.is_alive():
                break
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            steps.append(name)
            deadline = time.monotonic() + grace
            while sig != signal.SIGUSR1 and worker.process.is_alive() and time.monotonic() < deadline:
                worker.process.join(0.05)
            if sig == signal.SIGUSR1:
                time.sleep(min(grace, 0.2))
        worker.conn.close()
        _log.warning("worker pid %s: %s", pid, ", ".join(steps) or "already gone")
        return ", ".join(steps) or "already gone"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.conn.close()  # the worker's recv() gets EOF and returns
        for worker in workers:
            worker.process.join(_TERM_GRACE_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(_TERM_GRACE_S)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
