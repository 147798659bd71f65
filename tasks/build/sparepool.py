"""The build's compile pool, started ahead of the build by a command that waits meanwhile (for Kiln's server).

A compile worker costs seconds before its first unit: an interpreter, then
Triton's compiler and the project's kernel registry imported on its first call.
``kiln nightly`` (and ``kiln build``, ``kiln release``) wait about 11 s for
Kiln's server on a first run; :func:`prestart` starts the build's workers then,
each importing what a unit's compile imports first
(:func:`kiln.tasks.build.aot.warm_worker`), and the build's
:func:`~kiln.tasks.build.stage.compile_context` takes them (:func:`take`) when
it asks for the same workers: same config file, same size. A pool nobody takes
is closed when the process exits; its workers are registered for cancellation
like any pool's from their start.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.tasks.build.cuda_toolkits import toolkits_root
from kiln.tasks.build.pool import WorkerPool

_log = logging.getLogger(__name__)

WARM_TARGET = "kiln.tasks.build.aot:warm_worker"


@dataclass
class CompilePool:
    """A compile pool and the private Triton cache its workers were started with (removed with it)."""

    pool: WorkerPool
    triton_cache: tempfile.TemporaryDirectory[str]

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            self.triton_cache.cleanup()


# Where a pool's private directory goes: one path length on every machine and for every command, because
# ptxas's output follows the length of the file names it is given (kiln.tasks.build.aot.compiler_scratch).
# A system without a writable /tmp falls back to the process's temporary directory.
_SCRATCH_ROOT = "/tmp"


def _scratch_root() -> str | None:
    return _SCRATCH_ROOT if os.path.isdir(_SCRATCH_ROOT) and os.access(_SCRATCH_ROOT, os.W_OK | os.X_OK) else None


def new_pool(size: int, project: Path) -> CompilePool:
    """Workers for one build of the project in ``project`` (which they read), with a Triton cache of their own:
    Kiln's cache decides what is reused, and a cold build is really cold. The cache directory also holds the
    files Triton hands ``ptxas``, at a path of the same length wherever the pool starts. The workers also read
    the staged CUDA compilers (a ``cuda`` axis cell's ptxas: :mod:`kiln.tasks.build.cuda_toolkits`)."""
    cache = tempfile.TemporaryDirectory(prefix="kiln-triton-", dir=_scratch_root())
    return CompilePool(WorkerPool(size, {"TRITON_INTERPRET": None, "TRITON_CACHE_DIR": cache.name},
                                  read=(str(project), str(toolkits_root())), write=(cache.name,)), cache)


@dataclass
class _Spare:
    compile_pool: CompilePool
    config_file: str
    size: int


_spare: list[_Spare] = []  # at most one
_lock = threading.Lock()


def prestart(config_file: str, size: int, timeout_s: float) -> None:
    """Start ``size`` workers now, each importing what compiling a unit of ``config_file`` imports first.

    Returns at once (the workers start in threads); a failure is logged and left to the build, which meets it
    again. A pool started before and never taken is closed first.
    """
    discard()
    spare = _Spare(new_pool(size, Path(config_file).parent), config_file, size)
    with _lock:
        _spare.append(spare)
    for n in range(size):
        threading.Thread(target=_warm, args=(spare.compile_pool.pool, config_file, timeout_s), daemon=True,
                         name=f"kiln-compile-warm-{n}").start()


def _warm(pool: WorkerPool, config_file: str, timeout_s: float) -> None:
    try:
        pool.call(WARM_TARGET, config_file, timeout_s)
    except Exception as exc:  # a head start only: the build's first unit does it again and reports it
        _log.debug("warming a compile worker failed (its first unit imports again): %s", exc)


def take(config_file: str, size: int) -> CompilePool | None:
    """The pool :func:`prestart` started for ``config_file`` with ``size`` workers, once; None otherwise (and
    a pool started for something else is closed)."""
    with _lock:
        spare = _spare.pop() if _spare else None
    if spare is None:
        return None
    if (spare.config_file, spare.size) == (config_file, size):
        _log.info("compile workers started while Kiln's server started: %d", size)
        return spare.compile_pool
    spare.compile_pool.close()
    return None


def discard() -> None:
    """Close the pool :func:`prestart` started if nobody took it."""
    with _lock:
        spares = list(_spare)
        _spare.clear()
    for spare in spares:
        spare.compile_pool.close()


atexit.register(discard)  # a pool nobody took: its workers end with the command
