"""The compile cache for a package's own build: every compiler its pep517 backend runs goes through ccache.

A package's build picks its compilers itself: setuptools takes ``CC``/``CXX`` or the interpreter's
``gcc``/``g++`` by name from ``PATH``; torch's ``cpp_extension`` takes ``CXX`` or ``c++`` from ``PATH`` and
``PYTORCH_NVCC`` (else ``$CUDA_HOME/bin/nvcc``) for nvcc; CMake finds ``cc``/``c++``/``nvcc`` on ``PATH`` unless the
project names a compiler, and runs ``CMAKE_<LANG>_COMPILER_LAUNCHER`` before it; meson puts a ``ccache`` it finds
on ``PATH`` before the compilers it finds there.

Why a directory of shims first on ``PATH`` and not ``CC="ccache gcc"``: a two-word ``CC`` breaks torch's compiler
check (``shutil.which(CXX)``), CMake's compiler detection and ``-ccbin $CC``; each shim is one executable named
after its compiler, so every lookup by name (``which``, ``os.path.realpath`` then the name, ``-v``) finds a real
compiler behind it. The launcher variables cover a CMake project that names its compiler by absolute path.

Each shim execs ``ccache <the real compiler>``, naming that compiler by its absolute path (the one ``PATH`` had
before the shims), so nothing searches ``PATH`` again and finds the shim. Nested compiles are not cached twice:
the shims export :data:`ACTIVE`, and a shim that finds it set execs the real compiler directly. That is what
nvcc's own host compiles (``gcc`` from ``PATH``), a CMake launcher before a shim found as the compiler, and
meson's ``ccache <shim>`` reach; the ``ccache`` shim (the launcher CMake and meson run) sets it too, as Kiln's nvcc
does when it is CMake's CUDA launcher.

A hit is portable and its object the compile's own: ccache's base directory is the unit's folder
(``/tmp/kiln-pep517-<uid>/<key>/``: the copy of the project, its environment, its build tree), so every path
below it on a command line (sources, ``-I``, the ``-ffile-prefix-map`` Kiln adds) is hashed relative to the
compile's working directory, the same for another key (a Python change, one changed file) and another clone;
the path maps make the object name no such path, so a wheel is the same bytes whether the cache hit or not.

nvcc reads flags from ``NVCC_APPEND_FLAGS``/``NVCC_PREPEND_FLAGS``, which ccache does not see: their text, with
the unit's directory spelled as a fixed name, is hashed with every compile (``CCACHE_EXTRAFILES``), so a flag
change there is a miss, never another build's object. hipcc (a script in front of clang) gets a shim too: ccache
names its compiler by ``hipcc --version`` (the clang behind it), and hashes hipcc's own variables with its
compiles (``HIPCC_COMPILE_FLAGS_APPEND``, ``HIP_PLATFORM``, where ROCm lies).

Given ``cuobjdump``, nvcc's shim is Kiln's nvcc (:mod:`kiln.tasks.build.nvcc_split`): a compile for several archs
runs as one cached nvcc call per arch, so an added arch compiles alone. So is CMake's CUDA launcher, which gets
the nvcc CMake found (the shim, or one the project named by path) as its first argument. Under
``arch_policy = "narrow"`` nvcc gets no shim here: the narrowing nvcc is Kiln's nvcc too, and narrows first (it
records what it dropped on every compile, a hit included).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import posixpath
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from kiln.tasks.build.compile_cache import CompileCache, CompileStats, read_stats_log, warn_shared_faults
from kiln.tasks.build.nvcc_narrow import front_command

ACTIVE = "KILN_CCACHE_ACTIVE"  # set below a shim: a nested compiler call runs the real compiler
HOST_COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++")
# What nvcc reads from the environment, which ccache does not see (hashed with every compile: nvcc's host compiles
# are the shims' too); what hipcc reads, the flags it adds and where it finds its clang, device libraries and
# platform (amd or nvidia), hashed with hipcc's compiles only, so a worker without ROCm shares every other one
_NVCC_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")
_HIPCC_VARS = ("HIPCC_COMPILE_FLAGS_APPEND", "HIP_PLATFORM", "HIP_PATH", "ROCM_PATH", "HIP_CLANG_PATH",
               "DEVICE_LIB_PATH", "HIP_DEVICE_LIB_PATH")
_LANGS = ("C", "CXX", "CUDA", "HIP")
# hipcc is a script in front of clang: its own file says nothing of the clang it runs, its version output does
_HIPCC_CHECK = "%compiler% --version"
_UNIT_DIR = "/kiln/unit"  # how the hashed compiler variables spell the unit's directory
_PREFIX_MAP_VALUE = re.compile(r"(-f(?:file|debug|macro)-prefix-map=)[^\s'\"]*")
_CHUNK = 1 << 20
_ARCH_LABEL = re.compile(r" \[sm_[0-9]+[af]?\]$")  # how Kiln's nvcc names one arch's compile in the log


def _digest(path: str) -> str:
    """The compiler's bytes, named in the shim's own content, which ccache hashes when a launcher runs the shim
    itself: a new compiler at the same path is a miss."""
    info = os.stat(path)
    return _digest_of(os.path.realpath(path), info.st_size, info.st_mtime_ns)


@functools.cache
def _digest_of(path: str, size: int, mtime_ns: int) -> str:  # size, mtime: a replaced file is read again
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_shim(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}")
    path.chmod(0o755)


def _compiler_shim(path: Path, real: str, body: str) -> None:
    """A shim standing for the compiler ``real``: its bytes named first (:func:`_digest`), then ``body``."""
    _write_shim(path, f"# {real}: sha256 {_digest(real)}\n{body}")


def _cached(launcher: str, real: str) -> str:
    """A shim's body: ``real`` through ``launcher``, or ``real`` directly below another shim."""
    return (f"if [ -n \"${ACTIVE}\" ]; then exec {shlex.quote(real)} \"$@\"; fi\n"
            f"export {ACTIVE}=1\nexec {shlex.quote(launcher)} {shlex.quote(real)} \"$@\"\n")


def _kilns_nvcc(cache: CompileCache, real: str, cuobjdump: str, launched: Path | None = None) -> str:
    """A shim's body: Kiln's nvcc for ``real``, each arch a cached compile; ``launched``: as CMake's CUDA launcher,
    the compiler CMake found first among its arguments (``launched``, the nvcc shim, stands for ``real``)."""
    front = front_command(sys.executable, Path(real), (cache.launcher, ACTIVE), cuobjdump, launched=launched)
    return f"exec {shlex.join(front)} \"$@\"\n"


def _real_nvcc(environ: Mapping[str, str], path: str) -> str | None:
    """The nvcc torch's cpp_extension would run (``PYTORCH_NVCC``, else ``$CUDA_HOME/bin/nvcc``), else ``PATH``'s."""
    named = environ.get("PYTORCH_NVCC", "")
    if named and os.path.isabs(named) and os.access(named, os.X_OK):
        return named
    home = environ.get("CUDA_HOME")
    if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc", path=path)


def _flags_file(environ: Mapping[str, str], names: tuple[str, ...], unit_dir: Path, flags: Path) -> Path:
    """``flags``: the variables ``names``' text for ccache to hash, the unit's directory spelled as a fixed name,
    and the path maps' values dropped as ccache drops them on a command line (they name the worker's own folders,
    such as its build environments, and change no object's code)."""
    text = "\n".join(f"{name}={environ.get(name, '')}" for name in names)
    text = _PREFIX_MAP_VALUE.sub(r"\1", text)
    for spelling in sorted({os.path.abspath(unit_dir), os.path.realpath(unit_dir)}, key=len, reverse=True):
        text = text.replace(spelling, _UNIT_DIR)
    flags.write_text(text + "\n")
    return flags


def cached_compilers(cache: CompileCache, environ: Mapping[str, str], unit_dir: Path, where: Path,
                     stats_log: Path, *, nvcc: bool = True, cuobjdump: str | None = None) -> dict[str, str]:
    """``environ`` whose compilers go through ``cache``: shims in ``where`` first on ``PATH`` (the host compilers,
    hipcc, nvcc), the CMake launchers (CUDA's Kiln's nvcc given ``cuobjdump``), ``PYTORCH_NVCC`` (when ``nvcc``;
    split per arch given ``cuobjdump``) and ccache's settings, its base directory
    ``unit_dir`` (the unit's folder: its sources, its environment and its build tree, whose path differs with the
    unit's key and clone)."""
    where.mkdir(parents=True, exist_ok=True)
    path = environ.get("PATH", "")
    env = dict(environ)
    for name in HOST_COMPILERS:
        real = shutil.which(name, path=path)
        if real is not None:
            _compiler_shim(where / name, real, _cached(cache.launcher, real))
    real_hipcc = shutil.which("hipcc", path=path)
    if real_hipcc is not None:
        hip_vars = _flags_file(environ, _HIPCC_VARS, unit_dir, where / "hipcc-vars.txt")
        body = (f"export CCACHE_COMPILERCHECK={shlex.quote(_HIPCC_CHECK)}\n"
                f"export CCACHE_EXTRAFILES=\"$CCACHE_EXTRAFILES:\"{shlex.quote(str(hip_vars))}\n")
        _compiler_shim(where / "hipcc", real_hipcc, body + _cached(cache.launcher, real_hipcc))
    launcher = where / "ccache"
    _write_shim(launcher, f"export {ACTIVE}=1\nexec {shlex.quote(cache.launcher)} \"$@\"\n")
    env |= {f"CMAKE_{lang}_COMPILER_LAUNCHER": str(launcher) for lang in _LANGS}
    real_nvcc = _real_nvcc(environ, path) if nvcc else None
    if real_nvcc is not None:
        body = _cached(cache.launcher, real_nvcc)
        if cuobjdump:  # Kiln's nvcc, splitting a compile per arch; CMake's launcher splits the nvcc it found
            body = _kilns_nvcc(cache, real_nvcc, cuobjdump)
            _write_shim(where / "nvcc-launcher", _kilns_nvcc(cache, real_nvcc, cuobjdump, launched=where / "nvcc"))
            env["CMAKE_CUDA_COMPILER_LAUNCHER"] = str(where / "nvcc-launcher")
        _compiler_shim(where / "nvcc", real_nvcc, body)
        env["PYTORCH_NVCC"] = str(where / "nvcc")
    env |= cache.environ(unit_dir, stats_log)
    env["CCACHE_EXTRAFILES"] = str(_flags_file(environ, _NVCC_VARS, unit_dir, where / "nvcc-flags.txt"))
    env["PATH"] = os.pathsep.join(filter(None, [str(where), path]))
    env.pop(ACTIVE, None)
    return env


def unit_stats(stats_log: Path, source: Path) -> CompileStats:
    """The project's translation units ``stats_log`` records, named relative to its root.

    ccache names a source as its command line did once ``base_dir`` made every path below the unit's folder
    relative to the compile's working directory (a ninja build under ``build/temp.*`` gives
    ``../../csrc/ops.cpp``; CMake's tree beside the sources ``../src/ops.c``). A path that stayed absolute lies
    outside the unit's folder: a toolchain's own probe (CMake compiles ``CMakeCCompilerABI.c`` from its
    modules), not the project's, so it is not counted.
    """
    stats = read_stats_log(stats_log)

    def ours(entry: str) -> bool:
        path = _ARCH_LABEL.sub("", entry)
        return not os.path.isabs(path) or Path(path).is_relative_to(source)

    def name(entry: str) -> str:  # an arch Kiln's nvcc compiled alone keeps its label: "csrc/fill.cu [sm_90]"
        label = _ARCH_LABEL.search(entry)
        return _path_name(_ARCH_LABEL.sub("", entry)) + (label[0] if label else "")

    def _path_name(path: str) -> str:
        if Path(path).is_relative_to(source):
            return Path(path).relative_to(source).as_posix()
        below = Path(*itertools.dropwhile(lambda part: part == "..", Path(posixpath.normpath(path)).parts))
        # an out-of-tree build (CMake, meson) compiles from the unit's build tree: ../src/ops.c
        beside = source.parent / below
        return beside.relative_to(source).as_posix() if beside.is_relative_to(source) and beside.is_file() \
            else below.as_posix()

    return warn_shared_faults(CompileStats(tuple(name(p) for p in stats.compiled if ours(p)),
                                           tuple(name(p) for p in stats.reused if ours(p)),
                                           tuple(name(p) for p in stats.shared if ours(p)), stats.shared_faults),
                              source.name)
