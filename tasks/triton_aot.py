"""Ahead-of-time Triton compilation of one unit, and the ELF check of its output.

:func:`compile_in_worker` runs inside a build worker (see ``tasks.compile_pool``):
it loads the project's registry once per worker, finds the unit's
specialization and compiles it for a ``GPUTarget`` — cubin for CUDA, hsaco for
ROCm — which needs no GPU. Triton is imported only there, after the worker
has dropped ``TRITON_INTERPRET`` from its environment (with it set,
``@triton.jit`` yields interpreter objects that cannot be compiled).

:func:`check_elf_arch` proves a binary is for the arch its unit names, by
reading the ELF header: for a cubin the SM number in ``e_flags`` (its
position depends on the CUDA ELF ABI version), for an hsaco the
``EF_AMDGPU_MACH`` field.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

from release.errors import CompileError

_EM_CUDA = 190
_EM_AMDGPU = 224
# EF_AMDGPU_MACH values from LLVM's ELF.h (the gfx targets Kiln builds for).
_AMDGPU_MACH = {
    0x2F: "gfx906", 0x30: "gfx908", 0x3F: "gfx90a", 0x40: "gfx940", 0x4B: "gfx941", 0x4C: "gfx942",
    0x4F: "gfx950", 0x36: "gfx1030", 0x41: "gfx1100", 0x46: "gfx1101", 0x47: "gfx1102",
    0x48: "gfx1200", 0x4E: "gfx1201",
}


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
        return _AMDGPU_MACH.get(mach, f"amdgpu-mach-0x{mach:02x}")
    raise CompileError(f"compiler output has ELF machine {machine}, neither CUDA ({_EM_CUDA}) nor AMDGPU ({_EM_AMDGPU})")


def expected_elf_arch(backend: str, arch: str) -> str:
    if backend == "cuda":
        major, minor = arch.split("+")[0].rstrip("af").split(".")
        return f"sm_{int(major) * 10 + int(minor)}"
    return arch


def check_elf_arch(data: bytes, backend: str, arch: str, what: str) -> None:
    """Raise :class:`CompileError` unless ``data`` is a code object for ``arch``."""
    found, wanted = elf_arch(data), expected_elf_arch(backend, arch)
    if found != wanted:
        raise CompileError(f"{what}: compiled binary is for {found}, the plan asked for {wanted} ({arch})")


@functools.cache
def _registry(config_path: str) -> dict[tuple[str, str], Any]:
    from tasks.config import load_config
    from tasks.registry import load_registry

    entries = {}
    for spec in load_registry(load_config(config_path)):
        for entry in spec.triton:
            entries[(spec.name, entry.name)] = entry
    return entries


def _target(backend: str, arch: str) -> Any:
    from triton.backends.compiler import GPUTarget

    if backend == "cuda":
        major, minor = arch.split("+")[0].rstrip("af").split(".")
        return GPUTarget("cuda", int(major) * 10 + int(minor), 32)
    return GPUTarget("hip", arch, 64)


def compile_in_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Compile one unit; returns ``{"binary", "metadata", "kind", "asm_name"}``.

    ``request``: ``config``, ``kernel``, ``entry``, ``specialization``,
    ``backend``, ``arch``. Any exception propagates to the pool, which reports
    its message to the parent.
    """
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    entry = _registry(request["config"])[(request["kernel"], request["entry"])]
    spec = next(s for s in entry.specializations if s.name == request["specialization"])
    fn = entry.fn if isinstance(entry.fn, JITFunction) else JITFunction(entry.fn.fn)
    # Divisibility hints give the artifact the vectorised loads a JIT launch would
    # get; the kernel package launches it only for arguments that meet them.
    attrs = spec.triton_attrs(fn.arg_names) if getattr(spec, "aligned", ()) else None
    source = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
    options = dict(getattr(spec, "options", {}) or {})
    compiled = triton.compile(source, target=_target(request["backend"], request["arch"]), options=options)
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
