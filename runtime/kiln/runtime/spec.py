"""Kiln's public kernel spec types: how a kernel package describes its kernels.

A package's registry (``kiln.toml``'s ``project.registry``, ``"module:attribute"``)
returns a list of :class:`KernelSpec`. Kiln validates every field when it
loads the registry and copies what it reads into its own records, so a bad
spec is refused (naming the kernel, the specialization and the field) before
anything compiles. A registry may also return objects of its own classes if
they have every field of these types (Kiln checks them the same way).

Arch names: CUDA archs are ``"major.minor"`` strings, optionally suffixed
``a``/``f`` (``"9.0a"``, ``"10.0f"``) or ``+PTX``; ROCm archs are ``gfx`` names
(``"gfx942"``). ``native`` is refused. Backends are ``"cuda"`` and ``"hip"``.

Names (of kernels, entries, specializations, CUDA source sets and bench
cases) name build units and files: letters, digits, ``_``, ``.`` and ``-``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Backend = Literal["cuda", "hip", "cpu"]


@dataclass(frozen=True)
class Specialization:
    """One ahead-of-time compile of a Triton entry point.

    Fields:

    - ``name``: unique within the kernel; the artifact is ``<entry>__<name>.cubin``
      (or ``.hsaco``) and the runtime finds it by this name.
    - ``signature``: every parameter of the ``@triton.jit`` function (no more,
      no fewer) mapped to a Triton type string (``"*fp32"``, ``"i32"``,
      ``"fp32"``, ``"constexpr"``...).
    - ``constexprs``: the value of each parameter typed ``"constexpr"``, and of
      no other.
    - ``backends``: the backends this specialization is built for, a non-empty
      subset of ``("cuda", "hip")`` (e.g. an fp8 one only where fp8 exists).
    - ``min_arch``: backend -> the lowest arch it compiles for (lower targets
      are skipped with a reason).
    - ``options``: keyword options for ``triton.compile`` (``num_warps``...), so
      the artifact matches what the JIT launch would build.
    - ``aligned``: runtime parameters compiled as divisible by 16 (pointers:
      16-byte aligned), the hint Triton's JIT derives per call and that
      vectorizes memory access; the runtime launches such an artifact only for
      arguments that satisfy it.
    """

    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    backends: tuple[Backend, ...] = ("cuda", "hip")
    min_arch: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()

    def triton_attrs(self, arg_names: Sequence[str]) -> dict[tuple[int, ...], list[list[object]]]:
        """``ASTSource(..., attrs=...)`` for :attr:`aligned` (Triton ≥ 3.3 format)."""
        names = list(arg_names)
        return {(names.index(p),): [["tt.divisibility", 16]] for p in self.aligned}


@dataclass(frozen=True)
class TritonEntry:
    """A ``@triton.jit`` function and the specializations to compile.

    - ``name``: unique within the kernel; names the artifacts with the specialization.
    - ``fn``: the ``@triton.jit`` function (``triton.runtime.jit.JITFunction``),
      passed to ``triton.compile`` as it is; its ``arg_names`` are what every
      specialization's ``signature`` must cover.
    - ``specializations``: at least one :class:`Specialization`.
    """

    name: str
    fn: Any  # triton.runtime.jit.JITFunction
    specializations: tuple[Specialization, ...]


@dataclass(frozen=True)
class CudaSource:
    """A CUDA C++ source set built with ``nvcc`` into a shared library.

    - ``name``: names the build unit.
    - ``sources``: existing files, relative to the package directory (no
      absolute paths, no ``..``); they are hashed into the build cache key.
    - ``supported``: the CUDA archs the sources build for, e.g. ``("7.5", "8.0", "9.0")``.
    - ``library``: the output file name, ending in ``.so`` and unique in the
      registry (every library lands in the package's ``_aot/`` directory).
    """

    name: str
    sources: tuple[str, ...]  # paths relative to the package directory
    supported: tuple[str, ...]  # CUDA archs, e.g. ("7.5", "8.0", "9.0")
    library: str  # output file name, e.g. "libkiln_csrc.so"


@dataclass(frozen=True)
class BenchCase:
    """One benchmark case: ``fn(*inputs)`` timed beside ``reference(*inputs)``.

    - ``kernel``: the name of the kernel whose ``bench_cases`` returns it.
    - ``name``: names the case in results, tables and plots.
    - ``shape``: dimension name -> int size, reported with the results.
    - ``dtype``: the input dtype's name (``"float32"``; anything ``str()`` names is reported as that).
    - ``make_inputs(device)``: a fresh tuple of inputs; the harness calls it
      several times to build a rotation pool larger than L2.
    - ``fn`` / ``reference``: the kernel and the torch reference, both called as ``f(*inputs)``.
    - ``bytes`` / ``flops``: non-negative ints, the memory traffic and
      arithmetic of one call, for achieved bandwidth or FLOP rate (0 when not declared).
    """

    kernel: str
    name: str
    shape: dict[str, int]
    dtype: str
    make_inputs: Callable[[str], tuple[Any, ...]]
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    bytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class KernelSpec:
    """Everything the pipeline needs to know about one kernel.

    - ``name``: unique in the registry; names build units, artifacts' directory and results.
    - ``module``: the dotted module holding the kernel's source, inside the
      package; it and what it imports from the package make the cache key.
    - ``supported``: backend (``"cuda"``/``"hip"``) -> the archs the kernel runs
      on; the build is the loose intersection with each variant's archs.
    - ``triton``: the :class:`TritonEntry` objects compiled ahead of time.
    - ``csrc``: a :class:`CudaSource` built with nvcc, or None.
    - ``bench_cases``: ``size`` (``"small"``/``"large"``) -> a list of
      :class:`BenchCase`, or None for a kernel without benchmarks.
    - ``description``: one line for reports.
    """

    name: str
    module: str  # dotted module holding the kernel's source (for cache keys)
    supported: dict[str, tuple[str, ...]]  # backend -> archs
    triton: tuple[TritonEntry, ...] = ()
    csrc: CudaSource | None = None
    bench_cases: Callable[[str], list[BenchCase]] | None = None  # size -> cases
    description: str = ""
