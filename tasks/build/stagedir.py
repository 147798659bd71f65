"""A build directory whose absolute path depends only on the sources it holds.

nvcc's front end names every anonymous namespace after the absolute path of
its translation unit (``_GLOBAL__N__<hash of the path>_…``), and no flag maps
that away. A checkout's path differs on every worker (scale-out workers clone
into fresh temporary directories), so the same commit gave different cu130
libraries (invariant 8). Kiln copies the sources into
``/tmp/kiln-nvcc-<uid>/<digest of the library and its source names>/`` and compiles there, with
``-ffile-prefix-map`` mapping that directory to ``.`` for ``__FILE__`` (:func:`fixed_sources`). The name
is not the sources' content: a one-file change keeps the path, so the compile cache still serves the
other files' objects, which name their translation unit's path.

``/tmp`` and not ``$TMPDIR``: the path must be the same on every worker. The
per-user directory is created 0700 and refused, naming it, when another user
owns it or can write it; a lock per name keeps two builds of the same library
from sharing a half-written copy.

A ``pep517`` project build works the same way (:func:`fixed_dir`): its copy of
the project, its build directories and its throwaway environment live under
``/tmp/kiln-pep517-<uid>/<unit key>/``, a path named by what is built, so
nvcc's anonymous-namespace names and whatever path the project's build does
not let a prefix map reach are the same on every worker.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.core.errors import CompileError
from kiln.core.fsutil import polled_lock

_log = logging.getLogger(__name__)
BASE = Path("/tmp")
_POLL_S = 0.5


def _private_base(base: Path, kind: str = "nvcc") -> Path:
    root = base / f"kiln-{kind}-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CompileError(f"{root} is not a private directory of this user (a link, another owner, or open to"
                           " others): Kiln compiles native sources there; remove it and run the build again")
    return root


@contextmanager
def fixed_dir(kind: str, name: str, timeout_s: float, base: Path = BASE) -> Iterator[Path]:
    """An empty directory ``/tmp/kiln-<kind>-<uid>/<name>/``, this build's alone until the block ends, then removed.

    ``name`` names what is built there (a unit's cache key), so the path is the same on every worker; a build
    of the same thing waits (up to ``timeout_s``) for the one that holds it.
    """
    if not name or not name.replace("-", "").isalnum():
        raise CompileError(f"build directory name {name!r} is not a plain name (letters, digits, '-')")
    root = _private_base(base, kind)
    target = root / name
    with polled_lock(root / f"{name}.lock", time.monotonic() + timeout_s, f"building in {target}", CompileError):
        shutil.rmtree(target, ignore_errors=True)  # what a killed build left
        target.mkdir()
        try:
            yield target
        finally:
            shutil.rmtree(target, ignore_errors=True)


@contextmanager
def fixed_sources(sources: list[Path], name: str, timeout_s: float,
                  base: Path = BASE) -> Iterator[tuple[Path, list[Path]]]:
    """Copy the directory holding ``sources`` to ``/tmp/kiln-nvcc-<uid>/<name>/``; yield it and their new paths.

    ``name`` names what is built (a library and its source names), never the sources' content: the path stays the
    same when one file changes, so a per-file compile cache still serves every other file's object (an
    object names its translation unit's path); a build of the same thing waits for the one that holds it.
    """
    origin = Path(os.path.commonpath([str(s.resolve().parent) for s in sources]))
    with fixed_dir("nvcc", name, timeout_s, base) as target:
        shutil.copytree(origin, target, symlinks=False, dirs_exist_ok=True)
        _log.info("compiling %s from %s (a path named by what is built, the same on every worker)", origin, target)
        yield target, [target / s.resolve().relative_to(origin) for s in sources]
