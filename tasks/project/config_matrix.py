"""A variant's matrix axes: the Pythons and torches it is built for, less its exclusions.

``[[variants]]`` may list ``python = ["3.10", "3.11"]`` and ``torch = ["2.13.0", "2.14.1"]`` with
``exclude = [{python = "3.13", torch = "2.13.0"}]``. At load, :func:`expand` turns such a variant into one
variant per cell (invariant 13): each has a name of its own (``cpupy312``, ``cu130py312torch2141``: unit ids,
run-record rows and test units stay per name), the cell it stands for (:class:`Cell`: its Python, its torch,
the variant it came from) and the local label of its wheel: the variant's name, with the torch's
``major.minor`` when the torch axis has more than one value (``+cu130torch2.14``). The Python is in the
wheel's tag (``cp312``), not its label. A cell's torch replaces any torch in the variant's
``build_requires`` (``torch==<the cell's>``), so its build environment, its wheel's pin and its test
environment follow the cell. A variant without axes is not touched: its name, label and keys are as before.

Pure: validation raises ``ValueError`` naming the key, which :mod:`kiln.tasks.project.config` turns into a
``ConfigError``.
"""

from __future__ import annotations

import fnmatch
import platform as cpu_info
import re
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any, Protocol

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, model_validator


class Variant(Protocol):
    """What this module reads of :class:`kiln.tasks.project.config.Variant` (which imports this module)."""

    @property
    def name(self) -> str: ...
    @property
    def python(self) -> tuple[str, ...]: ...
    @property
    def torch(self) -> tuple[str, ...]: ...
    @property
    def exclude(self) -> tuple[Exclusion, ...]: ...
    @property
    def platform(self) -> tuple[str, ...]: ...
    @property
    def select(self) -> tuple[str, ...]: ...
    @property
    def model_fields_set(self) -> set[str]: ...
    @property
    def build_requires(self) -> tuple[str, ...]: ...
    @property
    def cell(self) -> Cell | None: ...
    @property
    def abi(self) -> str: ...
    @property
    def torch_target(self) -> str | None: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Variant: ...

_PYTHON = re.compile(r"^3\.(?:[0-9]|[1-9][0-9])$")
# The oldest CPython Kiln builds for: its own floor (requires-python of kiln-runtime).
MIN_PYTHON_MINOR = 8


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Exclusion(_Model):
    """One ``exclude`` entry: every cell matching all the keys it gives is not built."""

    python: str | None = None  # the Python of the cells left out (e.g. "3.13")
    torch: str | None = None  # the torch of the cells left out (e.g. "2.13.0")
    platform: str | None = None  # the CPU of the cells left out (e.g. "aarch64"), one of the variant's platform

    @model_validator(mode="after")
    def _something(self) -> Exclusion:
        if self.python is None and self.torch is None and self.platform is None:
            raise ValueError("an exclude entry names no axis: give python, torch, platform or several"
                             " (e.g. {python = \"3.13\", torch = \"2.13.0\"})")
        return self

    def matches(self, python: str | None, torch: str | None, platform: str | None = None) -> bool:
        return (self.python is None or self.python == python) and (self.torch is None or self.torch == torch) \
            and (self.platform is None or self.platform == platform)


class Cell(_Model):
    """What one expanded variant stands for: ``matrix`` is the ``[[variants]]`` name it came from."""

    matrix: str
    python: str | None = None  # a cell's Python (e.g. "3.12")
    torch: str | None = None  # a cell's torch requirement
    label: str
    # abi = "stable" with a torch axis: every torch of the axis, which its one wheel (built against the newest)
    # claims; the test stage runs its suites under each
    claims: tuple[str, ...] = ()


def python_minor(version: str) -> int:
    return int(version.split(".")[1])


def check_python_axis(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        if not _PYTHON.match(value):
            raise ValueError(f"{value!r} is not a CPython 'major.minor' version (e.g. \"3.12\")")
        if python_minor(value) < MIN_PYTHON_MINOR:
            raise ValueError(f"{value!r} is older than Python 3.{MIN_PYTHON_MINOR}, the oldest Kiln builds for")
    if len(set(values)) != len(values):
        raise ValueError(f"duplicate Pythons in {list(values)}")
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
    if len({Version(v) for v in values}) != len(values):
        raise ValueError(f"duplicate torches in {list(values)}")
    return tuple(sorted(values, key=Version))


def check_exclusions(pythons: Sequence[str], torches: Sequence[str], exclude: Sequence[Exclusion]) -> None:
    """Each exclusion names values of the axes the variant has (a typo would silently exclude nothing)."""
    for index, entry in enumerate(exclude):
        for axis, value, values in (("python", entry.python, pythons), ("torch", entry.torch, torches)):
            if value is not None and value not in values:
                have = f"the variant's {axis} axis is {list(values)}" if values else f"the variant has no {axis} axis"
                raise ValueError(f"exclude[{index}].{axis} = {value!r} matches no cell: {have}")


def built_for(variant: Variant, machine: str | None = None) -> tuple[str, ...]:
    """The CPUs ``variant``'s wheels are for: its ``platform`` when kiln.toml gives one, else the builder's own
    (``machine``, default this one's): the default stands for the CPU Kiln runs on, as before the key, so an
    aarch64 (Grace) machine builds and tests its own wheels of a variant that names none."""
    if "platform" in variant.model_fields_set:
        return tuple(variant.platform)
    return (machine or cpu_info.machine(),)


def cell_python(variant: Variant) -> str:
    """The CPython ``variant``'s wheel is built and tested for (``"3.12"``): its cell's, else Kiln's own."""
    if variant.cell is not None and variant.cell.python:
        return variant.cell.python
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def has_axes(variant: Variant) -> bool:
    """Whether ``variant`` is a matrix of cells: a Python or torch axis, or several CPUs."""
    return bool(variant.python or variant.torch or len(variant.platform) > 1)


def _torch_label(torch: str, torches: Sequence[str]) -> str:
    """``torch2.14``; the whole release when another torch of the axis shares its major.minor."""
    release = Version(torch).release
    short = ".".join(map(str, release[:2]))
    if sum(".".join(map(str, Version(t).release[:2])) == short for t in torches) > 1:
        short = ".".join(map(str, release))
    return f"torch{short}"


# The CPU a cell is for when its name says none: cells of any other CPU (``platform = [..., "aarch64"]``) end with
# it (``cpupy311aarch64``), so the x86_64 cells keep the names, unit ids and cache keys they had before the axis.
UNNAMED_PLATFORM = "x86_64"


def cell_name(variant: str, python: str | None, torch: str | None, torches: Sequence[str],
              platform: str = UNNAMED_PLATFORM) -> str:
    name = variant + (f"py3{python_minor(python)}" if python else "")
    if torch and len(torches) > 1:
        name += "torch" + "".join(map(str, Version(torch).release))
    return name + ("" if platform == UNNAMED_PLATFORM else platform)


def _with_torch(requirements: Sequence[str], torch: str) -> tuple[str, ...]:
    kept = [r for r in requirements if canonicalize_name(Requirement(r).name) != "torch"]
    return (*kept, f"torch=={torch}")


def _stable_once(variant: Variant) -> Variant:
    """An ``abi = "stable"`` variant builds once per Python, not once per torch: against the newest torch of its
    axis, targeting the oldest (its ``torch_target`` unless it declares one), so its one wheel requires
    ``torch>=<oldest>`` and loads under each (:mod:`kiln.tasks.build.stable_abi`)."""
    oldest = Version(variant.torch[0]).release  # check_torch_axis sorted the axis
    target = variant.torch_target or f"{oldest[0]}.{oldest[1]}"
    return variant.model_copy(update={"torch": variant.torch[-1:], "torch_target": target})


def expand(variant: Variant) -> tuple[Variant, ...]:
    """The variant's cells in axis order (Python, torch, then CPU), exclusions left out; itself without axes.

    A variant of several CPUs (``platform = ["x86_64", "aarch64"]``) is expanded with its axes: one cell per CPU
    of each (Python, torch), each with that CPU alone, the same label (its wheels differ by platform tag, so
    they share the variant's index) and a name that says the CPU (:func:`cell_name`)."""
    if not has_axes(variant):
        return selected(variant, (variant,))
    claims: tuple[str, ...] = ()
    if variant.abi == "stable" and len(variant.torch) > 1:
        claims = tuple(variant.torch)
        variant = _stable_once(variant)
    pythons: Sequence[str | None] = variant.python or (None,)
    torches: Sequence[str | None] = variant.torch or (None,)
    for index, entry in enumerate(variant.exclude):
        if entry.platform is not None and entry.platform not in variant.platform:
            raise ValueError(f"variant {variant.name!r}: exclude[{index}].platform = {entry.platform!r} matches no"
                             f" cell: the variant's platform is {list(variant.platform)}")
    cells = []
    for python in pythons:
        for torch in torches:
            label = variant.name + (_torch_label(torch, variant.torch) if torch and len(variant.torch) > 1 else "")
            for platform in variant.platform:
                if any(entry.matches(python, torch, platform) for entry in variant.exclude):
                    continue
                update: dict[str, object] = {
                    "name": cell_name(variant.name, python, torch, variant.torch, platform), "python": (),
                    "torch": (), "exclude": (), "select": (),
                    "cell": Cell(matrix=variant.name, python=python, torch=torch, label=label, claims=claims)}
                if "platform" in variant.model_fields_set:  # a cell of a default platform keeps it unset
                    update["platform"] = (platform,)
                if torch:
                    update["build_requires"] = _with_torch(variant.build_requires, torch)
                cells.append(variant.model_copy(update=update))
    if not cells:
        raise ValueError(f"variant {variant.name!r}: its exclude list leaves no cell of python {list(variant.python)}"
                         f" x torch {list(variant.torch)}; remove an exclusion or the variant")
    return selected(variant, tuple(cells))


def selected(variant: Variant, cells: tuple[Variant, ...]) -> tuple[Variant, ...]:
    """The ``cells`` of ``variant`` its ``select`` patterns name (shell-style, over cell names; all without one).
    A pattern that names no cell is an error naming it and the cells there are, as an exclusion's is."""
    if not variant.select:
        return cells
    names = [cell.name for cell in cells]
    unmatched = [pattern for pattern in variant.select if not fnmatch.filter(names, pattern)]
    if unmatched:
        raise ValueError(f"variant {variant.name!r}: select {unmatched} matches no cell; its cells are {names}")
    return tuple(cell for cell in cells if any(fnmatch.fnmatchcase(cell.name, p) for p in variant.select))


TORCH_ID = "/torch"  # a stable-ABI suite run's unit id ends with it and its torch: test/unit/cpu/torch2.14.1


def host_torch() -> str | None:
    """The public version of the torch Kiln's interpreter has (``2.13.0``), or None."""
    try:
        return Version(metadata.version("torch")).public
    except metadata.PackageNotFoundError:
        return None


def _pinned_torch(requirements: Sequence[str]) -> str | None:
    for text in requirements:
        req = Requirement(text)
        specs = list(req.specifier)
        if canonicalize_name(req.name) == "torch" and len(specs) == 1 and specs[0].operator == "==" \
                and "*" not in specs[0].version:
            return specs[0].version
    return None


def claimed_torches(variant: Variant) -> tuple[str, ...]:
    """The torches an ``abi = "stable"`` variant's one wheel claims, each run by its suites: its
    torch axis (:attr:`Cell.claims`), else the torch it builds against and its target torch (the host's when it
    is of that ``major.minor``, else ``<target>.0``), each at least its ``torch_target``; () for any other
    variant (one run, as before)."""
    if variant.abi != "stable":
        return ()
    host = host_torch()
    if variant.cell is not None and variant.cell.claims:
        wanted: tuple[str | None, ...] = variant.cell.claims
    else:
        target = variant.torch_target
        at_target = host if host and target and Version(host).release[:2] == Version(target).release[:2] \
            else (f"{target}.0" if target else None)
        wanted = (_pinned_torch(variant.build_requires) or host, at_target)
    floor = Version(variant.torch_target) if variant.torch_target else None
    return tuple(sorted({Version(t).public for t in wanted if t and (floor is None or Version(t) >= floor)},
                        key=Version))


def abi3_served(variants: Sequence[Variant], name: str, wheel: str) -> str:
    """Why cell ``name`` keeps no wheel of its own, or "": its wheel ``wheel`` is abi3 (``py_limited_api``: one
    wheel loads on every Python from the one it names) or has no Python ABI at all (``py3-none``), so the cell
    of its matrix with the lowest Python and the same torch carries it; two cells would write two wheels of one
    name (invariant 13)."""
    me = next((v for v in variants if v.name == name), None)
    cell = me.cell if me is not None else None
    tags = parse_wheel_filename(wheel)[3]
    if me is None or cell is None or not cell.python or not all(t.abi in ("abi3", "none") for t in tags):
        return ""
    # of its own CPU: an aarch64 cell's abi3 wheel is not the x86_64 one
    same = [v for v in variants if v.cell is not None and v.cell.matrix == cell.matrix and v.cell.torch == cell.torch
            and v.cell.python and v.platform == me.platform]
    lowest = min(same, key=lambda v: python_minor(v.cell.python))  # type: ignore[union-attr,arg-type]
    if lowest.name == name:
        return ""
    first = lowest.cell.python  # type: ignore[union-attr]
    kind = "an abi3 wheel" if any(t.abi == "abi3" for t in tags) else "a wheel of no Python ABI"
    return (f"not built: the build makes {kind} ({wheel}), one wheel for every Python from its own:"
            f" cell {lowest.name} (Python {first}) carries it; give variant {cell.matrix!r} one Python"
            f" (python = [\"{first}\"]): with py_limited_api (or no extension) the python axis is one cell")
