"""What makes a ``pep517`` project build independent of where it runs (invariant 8), through the ecosystem's flags.

A project's own build (setuptools, CMake, torch's ``cpp_extension``) writes the
paths it compiles from into its binaries: ``__FILE__`` in asserts and
``TORCH_CHECK`` (the project's sources and torch's headers), and debug info when
the interpreter's ``CFLAGS`` carry ``-g``. Kiln builds in a directory named by
the unit (:func:`kiln.tasks.build.stagedir.fixed_dir`) and, on top, maps every
path that differs between workers to a fixed name with ``-ffile-prefix-map``
(gcc and clang; it implies ``-fdebug-prefix-map`` and ``-fmacro-prefix-map``):

- the project's copy -> ``.``; the unit's build directory -> ``/kiln/build``;
- the variant's build environment (under the build cache, often inside the
  checkout) -> ``/kiln/build-env``; Kiln's own virtual environment (the torch a
  variant without one builds against) -> ``/kiln/python``.

The maps are appended to what the build already has (``CFLAGS``, ``CXXFLAGS``,
``LDFLAGS`` for link-time compilation, ``HIPCC_COMPILE_FLAGS_APPEND``, and
``NVCC_APPEND_FLAGS`` as ``-Xcompiler=`` for nvcc's host compiler, with
``--objdir-as-tempdir`` so nvcc's intermediate files, whose names the host
object keeps, are not named after its process id), so a variant's
``build_env`` flags are kept. ``SOURCE_DATE_EPOCH`` (the commit time)
and ``PYTHONHASHSEED=0`` are set unless the build environment sets them.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.core.errors import CompileError
from kiln.tasks.wheel.assemble import ZIP_EPOCH  # a wheel's stamp outside git: the build's epoch then too

_log = logging.getLogger(__name__)
_GIT_TIMEOUT_S = 60
#: What a pep517 build's bytes depend on beyond its sources and toolchain: this module's recipe (the path maps,
#: SOURCE_DATE_EPOCH, the fixed build directory) and the backend's environment (a cpu variant sees no CUDA
#: toolkit). Part of the unit's cache key: bump it when either changes, so no older output is reused.
BUILD_RECIPE = "pep517-reproducible-2"
# Flags read by gcc/clang drivers: the maps are appended. nvcc takes them for its host compiler only.
_COMPILER_FLAGS = ("CFLAGS", "CXXFLAGS", "LDFLAGS", "HIPCC_COMPILE_FLAGS_APPEND")
_NVCC_FLAGS = "NVCC_APPEND_FLAGS"
# nvcc names its intermediate files tmpxft_<pid>_…, and the host object's FILE symbol keeps that name: with this
# flag they are made beside the object and named after it (only with -c; other invocations ignore it).
_NVCC_OBJTEMP = "--objdir-as-tempdir"


def path_maps(source: Path, workdir: Path, build_env: Path | None) -> list[tuple[str, str]]:
    """``(prefix, replacement)`` for every path of the build that differs between workers, least specific first:
    the compilers apply the last map that matches, so a directory inside another keeps its own name."""
    named = [(workdir, "/kiln/build"), (source, ".")]
    if build_env is not None:
        named.insert(0, (build_env, "/kiln/build-env"))
    if sys.prefix != sys.base_prefix:  # a virtual environment: its path is the worker's choice
        named.insert(0, (Path(sys.prefix), "/kiln/python"))
    maps: dict[str, str] = {}
    for path, new in named:
        for spelling in (os.path.abspath(path), os.path.realpath(path)):  # a link in the path: both spellings
            maps[spelling] = new
    return sorted(maps.items(), key=lambda item: len(item[0]))


def map_flags(maps: Sequence[tuple[str, str]]) -> list[str]:
    for old, _ in maps:
        if "=" in old or "," in old:  # gcc splits the option at the first '=', nvcc's -Xcompiler at each ','
            raise CompileError(f"cannot map the build path {old!r}: it contains '=' or ','; build from a path"
                             " without them")
    return [f"-ffile-prefix-map={old}={new}" for old, new in maps]


def _appended(current: str | None, flags: Sequence[str]) -> str:
    return " ".join(filter(None, [(current or "").strip(), shlex.join(flags)]))


def reproducible_environ(environ: Mapping[str, str], maps: Sequence[tuple[str, str]], epoch: int) -> dict[str, str]:
    """``environ`` with the path maps appended to every compiler's flags, ``SOURCE_DATE_EPOCH`` and
    ``PYTHONHASHSEED`` set where it does not set them itself."""
    flags = map_flags(maps)
    out = dict(environ)
    for name in _COMPILER_FLAGS:
        out[name] = _appended(out.get(name), flags)
    out[_NVCC_FLAGS] = _appended(out.get(_NVCC_FLAGS), [_NVCC_OBJTEMP, *(f"-Xcompiler={flag}" for flag in flags)])
    out.setdefault("SOURCE_DATE_EPOCH", str(epoch))
    out.setdefault("PYTHONHASHSEED", "0")
    return out


def commit_time(project_dir: Path) -> int:
    """The committer time of the checkout's HEAD (seconds), or :data:`ZIP_EPOCH` outside git."""
    try:
        done = subprocess.run(["git", "-C", str(project_dir), "log", "-1", "--format=%ct", "HEAD"],
                              capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        _log.warning("no commit time for %s (%s): SOURCE_DATE_EPOCH=%d", project_dir, exc, ZIP_EPOCH)
        return ZIP_EPOCH
    text = done.stdout.strip()
    return max(int(text), ZIP_EPOCH) if done.returncode == 0 and text.isdigit() else ZIP_EPOCH
