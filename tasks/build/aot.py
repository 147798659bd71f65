"""Ahead-of-time Triton compilation of one unit, and the ELF check of its output.

:func:`compile_in_worker` runs inside a build worker (see ``kiln.tasks.build.pool``):
it loads the project's registry once per worker, finds the unit's
specialization and compiles it for a ``GPUTarget`` — cubin for CUDA, hsaco for
ROCm — which needs no GPU. Triton is imported only there, after the worker
has dropped ``TRITON_INTERPRET`` from its environment (with it set,
``@triton.jit`` yields interpreter objects that cannot be compiled).

:func:`check_elf_arch` proves a binary is for the arch its unit names, by
reading the ELF: for a cubin the SM number in ``e_flags`` (its position
depends on the CUDA ELF ABI version); for an hsaco the target the code
object names in its ``NT_AMDGPU_METADATA`` note (``amdhsa.target``),
which covers every gfx target the toolchain knows, with the
``EF_AMDGPU_MACH`` field as the fallback for a code object without one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.core.errors import CompileError
from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.registry_types import TritonRecord

_EM_CUDA = 190
_EM_AMDGPU = 224
# EF_AMDGPU_MACH values from LLVM's ELF.h: the fallback when a code object has no metadata note.
_AMDGPU_MACH = {
    0x2F: "gfx906", 0x30: "gfx908", 0x3F: "gfx90a", 0x40: "gfx940", 0x4B: "gfx941", 0x4C: "gfx942",
    0x4F: "gfx950", 0x36: "gfx1030", 0x41: "gfx1100", 0x46: "gfx1101", 0x47: "gfx1102", 0x44: "gfx1103",
    0x43: "gfx1150", 0x4A: "gfx1151", 0x55: "gfx1152", 0x58: "gfx1153", 0x48: "gfx1200", 0x4E: "gfx1201",
}
_SHT_NOTE = 7
_ADDR_NO_RANDOMIZE = 0x0040000  # <linux/personality.h>
_PERSONALITY_QUERY = 0xFFFFFFFF  # personality() with this argument only reads the current value
# The msgpack key and the target triple after it: "amdgcn-amd-amdhsa--gfx942",
# "amdgpu11.51-amd-amdhsa-unknown-gfx1151" (newer LLVM), with optional ":xnack-" features.
_AMDGPU_TARGET = re.compile(rb"amdhsa\.target.{1,3}?[A-Za-z0-9._-]*?(gfx[0-9a-f]+)", re.S)


def _notes(data: bytes) -> list[tuple[bytes, int, bytes]]:
    """(owner, type, descriptor) of every note in the ELF64's SHT_NOTE sections."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    notes = []
    for index in range(shnum):
        base = shoff + index * shentsize
        if base + 0x28 > len(data):
            break
        sh_type = struct.unpack_from("<I", data, base + 4)[0]
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        if sh_type != _SHT_NOTE or offset + size > len(data):
            continue
        at, end = offset, offset + size
        while at + 12 <= end:
            namesz, descsz, kind = struct.unpack_from("<III", data, at)
            name_at = at + 12
            desc_at = name_at + (namesz + 3) // 4 * 4
            notes.append((data[name_at:name_at + namesz].rstrip(b"\0"), kind, data[desc_at:desc_at + descsz]))
            at = desc_at + (descsz + 3) // 4 * 4
    return notes


def amdgpu_target(data: bytes) -> str | None:
    """The gfx target an AMDGPU code object's metadata note names, or None."""
    for owner, _, desc in _notes(data):
        if owner == b"AMDGPU":
            match = _AMDGPU_TARGET.search(desc)
            if match:
                return match[1].decode()
    return None


def elf_arch(data: bytes) -> str:
    """``"sm_90"``-style or gfx name of an ELF code object (no suffix for cubins)."""
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] != 2:
        raise CompileError(f"compiler output is not a 64-bit ELF file ({len(data)} bytes)")
    machine = struct.unpack_from("<H", data, 18)[0]
    flags = struct.unpack_from("<I", data, 48)[0]
    if machine == _EM_CUDA:
        abi = data[8]
        # CUDA ELF ABI 8 (CUDA 12.8+) moved the SM number up one byte.
        sm = (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF
        return f"sm_{sm}"
    if machine == _EM_AMDGPU:
        mach = flags & 0xFF
        return amdgpu_target(data) or _AMDGPU_MACH.get(mach, f"amdgpu-mach-0x{mach:02x}")
    raise CompileError(f"compiler output has ELF machine {machine}, "
                       f"neither CUDA ({_EM_CUDA}) nor AMDGPU ({_EM_AMDGPU})")


def expected_elf_arch(backend: str, arch: str) -> str:
    if backend == "cuda":
        parsed = parse_cuda_arch(arch)
        return f"sm_{parsed.major * 10 + parsed.minor}"
    return arch


def check_elf_arch(data: bytes, backend: str, arch: str, what: str) -> None:
    """Raise :class:`CompileError` unless ``data`` is a code object for ``arch``."""
    found, wanted = elf_arch(data), expected_elf_arch(backend, arch)
    if found != wanted:
        raise CompileError(f"{what}: compiled binary is for {found}, the plan asked for {wanted} ({arch})")


@functools.cache
def _registry(config_path: str) -> dict[tuple[str, str], TritonRecord]:
    from kiln.tasks.project.config import load_config
    from kiln.tasks.project.registry import load_registry

    config = load_config(config_path)
    entries = {}
    for kernel in load_registry(config):
        for entry in kernel.triton:
            entries[(kernel.name, entry.name)] = entry
    relative_sources(config.project.package, config.import_root)
    return entries


def relative_sources(package: str, root: Path) -> None:
    """Name every Triton function of ``package`` by its path relative to ``root`` in line info.

    Triton writes each function's source file into the binary's debug line
    table; with absolute paths two clones of one commit would build different
    cubins. Relative paths (``pkg/add.py``) keep line info useful to a
    profiler and the bytes the same wherever the checkout is.
    """
    import sys

    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for value in list(vars(module).values()):
            jit = value if isinstance(value, JITFunction) else getattr(value, "fn", None)
            if isinstance(jit, JITFunction):
                _relative(jit, root)


# Any: a Triton JITFunction (Triton carries no types)
def _relative(jit: Any, root: Path) -> None:
    """Triton 3.9 reads the path from ``jit.file_name``, 3.6/3.7 from the function's code object: set both."""
    code = jit.fn.__code__
    if not Path(code.co_filename).is_absolute():
        return
    try:
        relative = Path(code.co_filename).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return  # defined outside the project (a library's helper): not ours to rename
    jit.fn.__code__ = code.replace(co_filename=relative)
    if hasattr(jit, "file_name"):
        jit.file_name = relative


def _import_root(config_path: str) -> Path:
    from kiln.tasks.project.config import load_config

    return load_config(config_path).import_root


def _target(backend: str, arch: str) -> Any:
    from triton.backends.compiler import GPUTarget

    if backend == "cuda":
        parsed = parse_cuda_arch(arch)
        return GPUTarget("cuda", parsed.major * 10 + parsed.minor, 32)
    return GPUTarget("hip", arch, 64)


@contextmanager
def fixed_address_layout() -> Iterator[None]:
    """Within the block, the programs this process starts (Triton's ``ptxas``) run without address-space
    randomisation; the previous personality is restored after it.

    ``ptxas`` 13.1 orders some register-allocation choices by heap address, so the same PTX gives a different
    sm_100 cubin (a few swapped registers) from one run to the next unless its address layout is fixed: which
    worker compiled a unit, warmed ahead or fresh, decided the wheel's bytes. The flag is inherited across
    fork and exec (what ``setarch -R`` does); this process's own layout, mapped already, is unchanged. Where
    the call does not exist (not Linux) the block runs as it is.
    """
    personality = getattr(ctypes.CDLL(None, use_errno=True), "personality", None) if sys.platform == "linux" else None
    if personality is None:
        yield
        return
    personality.argtypes, personality.restype = [ctypes.c_ulong], ctypes.c_int
    before = personality(_PERSONALITY_QUERY)
    if before == -1 or personality(before | _ADDR_NO_RANDOMIZE) == -1:
        raise CompileError(f"cannot turn off address-space randomisation for the compiler "
                           f"(personality: {ctypes.get_errno()}); its output would depend on the run")
    try:
        yield
    finally:
        personality(before)


@contextmanager
def compiler_scratch() -> Iterator[None]:
    """Within the block, Triton writes the PTX it hands ``ptxas`` (and ``ptxas`` its cubin) under
    ``$TRITON_CACHE_DIR/tmp``, not the worker's ``TMPDIR``.

    Even with a fixed address layout, ``ptxas``'s heap, and so its register allocation, follows the length of
    the file names it is given: a worker's private ``TMPDIR`` (under the parent's, with the worker's number in
    it) would make the bytes depend on where and how many workers ran. The compile pool's private directory
    has one length everywhere (kiln.tasks.build.sparepool.new_pool), and the names ``tempfile`` adds do too.
    """
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        yield
        return
    scratch = Path(cache) / "tmp"
    scratch.mkdir(exist_ok=True)
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        yield
    finally:
        tempfile.tempdir = before


def warm_worker(config_path: str) -> None:
    """What compiling a unit of ``config_path`` imports first (Triton's compiler, the project's registry),
    done ahead of the first unit (kiln.tasks.build.sparepool)."""
    import triton.compiler  # noqa: F401

    _registry(config_path)


@contextmanager
def cell_compilers(environ: Mapping[str, str]) -> Iterator[None]:
    """Within the block, Triton runs the compilers a cell's axes name (``TRITON_PTXAS_PATH``: the ``cuda``
    axis's release), and its backend's key is read again: Triton caches the ``ptxas`` version per arch for the
    life of the process, and a worker compiles for cells of several releases in turn."""
    if not environ:
        yield
        return
    from triton.backends.nvidia import compiler as nvidia

    # Triton 3.6-3.9 cache it so; a Triton that does not has nothing to forget
    forget = getattr(getattr(nvidia, "get_ptxas_version", None), "cache_clear", lambda: None)
    before = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)
    forget()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        forget()


def compile_in_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Compile one unit; returns ``{"binary", "metadata", "kind", "asm_name"}``.

    ``request``: ``config``, ``kernel``, ``entry``, ``specialization``,
    ``backend``, ``arch``. A failure of Triton's compiler is a
    :class:`CompileError` naming the unit (translated here, the one place
    that calls Triton's compiler); anything else (an import, the registry, a
    bug) propagates as itself and the pool reports it as an error of the worker.
    """
    import triton
    from triton.compiler import ASTSource
    from triton.errors import TritonError
    from triton.runtime.jit import JITFunction

    entry = _registry(request["config"])[(request["kernel"], request["entry"])]
    spec = next(s for s in entry.specializations if s.name == request["specialization"])
    if not isinstance(entry.fn, JITFunction) and not callable(getattr(entry.fn, "fn", None)):
        raise CompileError(f"kernel {request['kernel']!r} entry {request['entry']!r}: its fn "
                           f"{getattr(entry.fn, '__qualname__', type(entry.fn).__name__)!r} is not a Triton kernel;"
                           " decorate it with @triton.jit")
    fn = entry.fn if isinstance(entry.fn, JITFunction) else JITFunction(entry.fn.fn)
    if fn is not entry.fn:  # rebuilt from an interpreter-mode function: its path is absolute again
        _relative(fn, _import_root(request["config"]))
    # Divisibility hints give the artifact the vectorised loads a JIT launch would
    # get; the kernel package launches it only for arguments that meet them.
    attrs = spec.triton_attrs(fn.arg_names) if spec.aligned else None
    source = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
    options = dict(spec.options)
    target = _target(request["backend"], request["arch"])
    try:
        with fixed_address_layout(), compiler_scratch(), cell_compilers(request.get("environ") or {}):
            compiled = triton.compile(source, target=target, options=options)
    except (TritonError, RuntimeError) as exc:  # RuntimeError: an MLIR pass of Triton's pipeline failed
        what = f"kernel {request['kernel']!r} specialization {spec.name!r} for {request['backend']} {request['arch']}"
        raise CompileError(f"{what}: Triton failed to compile: {type(exc).__name__}: {exc}") from exc
    kind = "cubin" if request["backend"] == "cuda" else "hsaco"
    meta_path = next(p for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    with open(meta_path, "rb") as handle:
        metadata = handle.read()
    return {"binary": compiled.asm[kind], "metadata": metadata, "kind": kind}


def toolchain_versions() -> dict[str, str]:
    """Versions that change compiled bytes, read from package metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("triton", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out
