"""Ahead-of-time compilation of registry specializations, and loading the
results back. Works without a GPU for any CUDA or ROCm target.

Artifact layout (what the build stage writes under ``kernels/_aot/``): the
binary (``<stem>.cubin`` / ``<stem>.hsaco``) and, beside it, ``<stem>.json``,
Triton's own metadata for that binary (kernel name, warps, shared memory...).
A binary is only valid for the Triton version that produced it. Loading one
back at run time is :mod:`kiln.runtime.loader`'s job.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kiln.runtime.archs import cuda_arch_key
from kiln.runtime.spec import Specialization

_log = logging.getLogger(__name__)


def target_for(backend: str, arch: str) -> GPUTarget:
    """``("cuda", "9.0")`` -> ``GPUTarget("cuda", 90, 32)``; ``("hip", "gfx942")``
    -> ``GPUTarget("hip", "gfx942", 64)``."""
    if backend == "cuda":
        major, minor = cuda_arch_key(arch)
        return GPUTarget("cuda", major * 10 + minor, 32)
    if backend == "hip":
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"no ahead-of-time target for backend {backend!r}")


def binary_kind(backend: str) -> str:
    return {"cuda": "cubin", "hip": "hsaco"}[backend]


def jit_function(fn: Any) -> JITFunction:
    """A compilable ``JITFunction`` even when the module was imported with
    ``TRITON_INTERPRET=1`` (the decorator then yields an interpreter object
    that ``triton.compile`` cannot use)."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


def source(fn: Any, spec: Specialization) -> ASTSource:
    fn = jit_function(fn)
    return ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs),
                     attrs=spec.triton_attrs(fn.arg_names))


def compile_specialization(fn: Any, spec: Specialization, target: GPUTarget) -> Any:
    """Compile one specialization; returns Triton's ``CompiledKernel``."""
    _log.debug("compiling %s for %s", spec.name, target)
    return triton.compile(source(fn, spec), target=target, options=dict(spec.options))


def write_artifact(compiled: Any, directory: Path, stem: str) -> Path:
    """Write the binary and its Triton metadata as ``directory/stem.*``;
    returns the binary's path."""
    kind = "cubin" if "cubin" in compiled.asm else "hsaco"
    directory.mkdir(parents=True, exist_ok=True)
    binary = directory / f"{stem}.{kind}"
    binary.write_bytes(compiled.asm[kind])
    meta = next(Path(p) for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    shutil.copyfile(meta, binary.with_suffix(".json"))
    return binary
