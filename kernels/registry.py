"""The kernel registry: the only way the pipeline learns about kernels.

Kiln's build and benchmark stages read ``kiln.toml``'s ``project.registry``
(``"module:attribute"``), call it, and get a list of :class:`KernelSpec`.
Another kernel package provides its own registry with objects of the same
shape (these dataclasses, or anything with the same attributes).

Arch names: CUDA archs are ``"major.minor"`` strings, optionally suffixed
``a``/``f`` (``"9.0a"``, ``"10.0f"``); ROCm archs are ``gfx`` names
(``"gfx942"``). ``supported`` maps a backend (``"cuda"``/``"hip"``) to the
archs the kernel can run on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Backend = Literal["cuda", "hip", "cpu"]


@dataclass(frozen=True)
class Specialization:
    """One ahead-of-time compile of a Triton entry point.

    ``signature`` maps every parameter of the ``@triton.jit`` function to a
    Triton type string (``"*fp32"``, ``"i32"``, ``"constexpr"``...);
    ``constexprs`` gives the value of each ``constexpr`` parameter.
    ``backends`` restricts the specialization (e.g. an fp8 one) to some
    backends; ``min_arch`` maps a backend to the lowest arch it compiles for.
    ``options`` are passed to ``triton.compile`` (``num_warps``...), so the
    artifact matches what the JIT launch would build.
    """

    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    backends: tuple[Backend, ...] = ("cuda", "hip")
    min_arch: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TritonEntry:
    """A ``@triton.jit`` function and the specializations to compile."""

    name: str
    fn: Any  # triton.runtime.jit.JITFunction
    specializations: tuple[Specialization, ...]


@dataclass(frozen=True)
class CudaSource:
    """A CUDA C++ source set built with ``nvcc`` into a shared library."""

    name: str
    sources: tuple[str, ...]  # paths relative to the package directory
    supported: tuple[str, ...]  # CUDA archs, e.g. ("7.5", "8.0", "9.0")
    library: str  # output file name, e.g. "libkiln_csrc.so"


@dataclass(frozen=True)
class BenchCase:
    """One benchmark case: ``fn(*inputs)`` timed beside ``reference(*inputs)``.

    ``make_inputs(device)`` returns a fresh tuple of inputs; the harness calls
    it several times to build a rotation pool. ``bytes`` / ``flops`` let the
    harness report achieved bandwidth or FLOP rate (0 when not declared).
    """

    kernel: str
    name: str
    shape: dict[str, int]
    dtype: str
    make_inputs: Callable[[str], tuple]
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    bytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class KernelSpec:
    """Everything the pipeline needs to know about one kernel."""

    name: str
    module: str  # dotted module holding the kernel's source (for cache keys)
    supported: dict[str, tuple[str, ...]]  # backend -> archs
    triton: tuple[TritonEntry, ...] = ()
    csrc: CudaSource | None = None
    bench_cases: Callable[[str], list[BenchCase]] | None = None  # size -> cases
    description: str = ""
