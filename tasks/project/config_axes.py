"""The matrix axes a ``[[variants]]`` table may give, as one table: a new axis is one entry of :data:`AXES`.

An :class:`Axis` says everything Kiln does with its key: how its values are checked and ordered, the fragment
each value adds to a cell's name (``py312``, ``torch2141``, ``cu128``, ``aarch64``), the fragment it adds to
the cell's wheel label, what the cell's variant keeps of the key, and, for an axis that changes how a cell is
built, the ``"module:attr"`` of the function that says how (:attr:`Axis.toolchain`, resolved by the build
stage, so this table imports nothing of it). :func:`kiln.tasks.project.config_matrix.expand` walks the table;
nothing else names an axis to make cells.

The axes, in the order a cell's name spells them:

- ``python``: the CPython of the cell's wheel (its tag, not its label);
- ``torch``: the torch it builds against (in its label when the axis has several);
- ``cuda``: the CUDA release its device code is compiled with (``"12.8"``, ``"13.0"``), for code that needs
  no torch of that CUDA (Kiln's ahead-of-time kernels, a plain CUDA library): its ``ptxas`` and ``nvcc``
  come from NVIDIA's CUDA wheels on PyPI where the machine's toolkit is another release
  (:mod:`kiln.tasks.build.cuda_toolkits`);
- ``platform``: the CPU (its wheel's platform tag; ``x86_64`` cells keep the names they had before the key).

Pure: a check raises ``ValueError`` naming the value, which the config loader turns into a ``ConfigError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

_PYTHON = re.compile(r"^3\.(?:[0-9]|[1-9][0-9])$")
_CUDA = re.compile(r"^(1[1-9]|[2-9][0-9])\.[0-9]$")
# The oldest CPython Kiln builds for: its own floor (requires-python of kiln-runtime).
MIN_PYTHON_MINOR = 8
# The CPU a cell is for when its name says none: cells of any other CPU (``platform = [..., "aarch64"]``) end with
# it (``cpupy311aarch64``), so the x86_64 cells keep the names, unit ids and cache keys they had before the axis.
UNNAMED_PLATFORM = "x86_64"


@dataclass(frozen=True)
class Axis:
    """One matrix axis: the ``[[variants]]`` key and what a cell does with each of its values."""

    key: str  # the [[variants]] key, e.g. "cuda"
    check: Callable[[Sequence[str]], tuple[str, ...]]  # the values checked, in axis order; ValueError naming one
    fragment: Callable[[str, Sequence[str]], str]  # a value's part of the cell name, given the axis's values
    label: Callable[[str, Sequence[str]], str] = lambda value, values: ""  # its part of the wheel's local label
    keeps: bool = False  # whether the cell's variant keeps the key as (its value,): the CPU of its wheel
    # "module:attr" of toolchain(value) -> environment variables the cell's compilers run with; "" none
    toolchain: str = ""


def python_minor(version: str) -> int:
    return int(version.split(".")[1])


def _distinct(values: Sequence[str], plural: str, same: Callable[[str], object] = str) -> None:
    if len({same(v) for v in values}) != len(values):
        raise ValueError(f"duplicate {plural} in {list(values)}")


def check_python_axis(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        if not _PYTHON.match(value):
            raise ValueError(f"{value!r} is not a CPython 'major.minor' version (e.g. \"3.12\")")
        if python_minor(value) < MIN_PYTHON_MINOR:
            raise ValueError(f"{value!r} is older than Python 3.{MIN_PYTHON_MINOR}, the oldest Kiln builds for")
    _distinct(values, "Pythons")
    return tuple(sorted(values, key=python_minor))


def check_torch_axis(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        try:
            parsed = Version(value)
        except InvalidVersion as exc:
            raise ValueError(f"{value!r} is not a torch version (PEP 440, e.g. \"2.14.1\")") from exc
        if parsed.local or len(parsed.release) < 2:
            raise ValueError(f"{value!r}: give a torch release without a local part (e.g. \"2.14.1\", not"
                             " \"2.14.1+cu130\"); the variant's backend picks the build")
    _distinct(values, "torches", Version)
    return tuple(sorted(values, key=Version))


def check_cuda_axis(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        if not _CUDA.match(value):
            raise ValueError(f"{value!r} is not a CUDA release 'major.minor' (e.g. \"12.8\", \"13.0\")")
    _distinct(values, "CUDA releases")
    return tuple(sorted(values, key=Version))


def check_platform_axis(values: Sequence[str]) -> tuple[str, ...]:
    """Names only: the closed set of CPUs is the variant model's (``Platform``)."""
    _distinct(values, "platforms")
    return tuple(values)


def _torch_short(torch: str, torches: Sequence[str]) -> str:
    """``2.14``; the whole release when another torch of the axis shares its major.minor."""
    release = Version(torch).release
    short = ".".join(map(str, release[:2]))
    if sum(".".join(map(str, Version(t).release[:2])) == short for t in torches) > 1:
        short = ".".join(map(str, release))
    return short


def cuda_fragment(value: str) -> str:
    """``cu128`` for CUDA 12.8: the spelling torch's and Kiln's CUDA variants use."""
    return "cu" + value.replace(".", "")


PYTHON = Axis("python", check_python_axis, lambda value, values: f"py3{python_minor(value)}")
TORCH = Axis("torch", check_torch_axis,
             lambda value, values: "torch" + "".join(map(str, Version(value).release)) if len(values) > 1 else "",
             label=lambda value, values: f"torch{_torch_short(value, values)}" if len(values) > 1 else "")
CUDA = Axis("cuda", check_cuda_axis, lambda value, values: cuda_fragment(value),
            label=lambda value, values: cuda_fragment(value) if len(values) > 1 else "",
            toolchain="kiln.tasks.build.cuda_toolkits:toolchain_env")
PLATFORM = Axis("platform", check_platform_axis,
                lambda value, values: "" if value == UNNAMED_PLATFORM else value, keeps=True)

# Every axis, in the order a cell's name spells them (and expand walks them).
AXES: tuple[Axis, ...] = (PYTHON, TORCH, CUDA, PLATFORM)
AXIS_KEYS: tuple[str, ...] = tuple(axis.key for axis in AXES)


def axis(key: str) -> Axis:
    return next(a for a in AXES if a.key == key)


__all__ = ["AXES", "AXIS_KEYS", "Axis", "MIN_PYTHON_MINOR", "UNNAMED_PLATFORM", "axis", "check_cuda_axis",
           "check_platform_axis", "check_python_axis", "check_torch_axis", "cuda_fragment", "python_minor"]
