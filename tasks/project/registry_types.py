"""Kiln's own frozen records of a project's kernel registry.

:func:`kiln.tasks.project.registry.load_registry` validates what the project's
registry returns (``kiln.runtime.spec`` objects, or duck-typed objects of the
same shape) and copies every field the planner, the compile workers and the
benchmark harness read into these records. Nothing downstream touches the
project's objects except the callables carried as they are: a Triton entry's
``fn``, a kernel's ``bench_cases`` and a case's ``make_inputs``/``fn``/``reference``.
The planner reads the records as data a guest sent (:mod:`kiln.tasks.project.registry_guest`):
without those callables, and with a value of the project's own type as an :class:`OpaqueValue`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

K = TypeVar("K")
V = TypeVar("V")

GpuBackend = Literal["cuda", "hip"]


class FrozenMap(Mapping[K, V], Generic[K, V]):
    """A read-only copy of a mapping (compares equal to a dict with the same items)."""

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._data: dict[K, V] = dict(items or {})

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class OpaqueValue:
    """A constexpr or option whose type JSON does not keep, as the planner gets it from the registry's guest: its
    ``repr`` (what plan keys hash), and its JSON form when it is a scalar of a derived type (an IntEnum), else None."""

    text: str
    scalar: bool | int | float | str | None = None

    def __repr__(self) -> str:
        return self.text


@dataclass(frozen=True)
class SpecializationRecord:
    """One ahead-of-time compile of a Triton entry (see ``kiln.runtime.spec.Specialization``)."""

    name: str
    signature: FrozenMap[str, str]  # every parameter -> Triton type string
    constexprs: FrozenMap[str, Any]  # each "constexpr" parameter -> its value
    backends: tuple[GpuBackend, ...]
    min_arch: FrozenMap[str, str]  # backend -> lowest arch (canonical spelling)
    options: FrozenMap[str, Any]  # triton.compile options
    aligned: tuple[str, ...]  # parameters compiled as divisible by 16

    def triton_attrs(self, arg_names: Sequence[str]) -> dict[tuple[int, ...], list[list[object]]]:
        """``ASTSource(..., attrs=...)`` for :attr:`aligned` (Triton >= 3.3 format)."""
        names = list(arg_names)
        return {(names.index(p),): [["tt.divisibility", 16]] for p in self.aligned}


@dataclass(frozen=True)
class TritonRecord:
    name: str
    fn: Any  # the project's @triton.jit function, carried as it is (None in the planner's data)
    specializations: tuple[SpecializationRecord, ...]
    fn_module: str = ""  # the module fn is defined in (its source is a unit's input)


@dataclass(frozen=True)
class CudaSourceRecord:
    name: str
    sources: tuple[str, ...]  # existing files, relative to the package directory
    supported: tuple[str, ...]  # CUDA archs (canonical spelling)
    library: str  # a ``.so`` file name, unique in the registry


@dataclass(frozen=True)
class KernelRecord:
    name: str
    module: str  # a module of the project's package
    supported: FrozenMap[str, tuple[str, ...]]  # backend -> archs (canonical spelling)
    triton: tuple[TritonRecord, ...] = ()
    csrc: CudaSourceRecord | None = None
    bench_cases: Callable[[str], Sequence[Any]] | None = None  # size -> cases, read by the harness
    description: str = ""


@dataclass(frozen=True)
class BenchCaseRecord:
    """One benchmark case as the harness reads it (see ``kiln.runtime.spec.BenchCase``)."""

    kernel: str
    name: str
    shape: FrozenMap[str, int]
    dtype: str
    make_inputs: Callable[[str], tuple[Any, ...]]
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    bytes: int = 0
    flops: int = 0
