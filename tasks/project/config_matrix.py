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
import itertools
import platform as cpu_info
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from pydantic import BaseModel, ConfigDict

from kiln.tasks.project.config_axes import AXES, AXIS_KEYS, python_minor
from kiln.tasks.project.config_project import pinned_version


class Variant(Protocol):
    """What this module reads of :class:`kiln.tasks.project.config.Variant` (which imports this module)."""

    @property
    def name(self) -> str: ...
    @property
    def python(self) -> tuple[str, ...]: ...
    @property
    def torch(self) -> tuple[str, ...]: ...
    @property
    def cuda(self) -> tuple[str, ...]: ...
    @property
    def exclude(self) -> tuple[str | dict[str, str], ...]: ...
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

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Exclusion:
    """One ``exclude`` entry: a table of axis values (every cell matching all the keys it gives is not built,
    ``{python = "3.13", torch = "2.13.0"}``) or a shell-style pattern over cell names (``"*py313torch2130"``)."""

    values: Mapping[str, str]  # axis key -> the value of the cells left out
    pattern: str = ""  # a pattern over cell names, as select's

    def matches(self, name: str, values: Mapping[str, str | None]) -> bool:
        if self.pattern:
            return fnmatch.fnmatchcase(name, self.pattern)
        return all(values.get(key) == value for key, value in self.values.items())


def exclusion(entry: str | Mapping[str, str]) -> Exclusion:
    """The exclusion ``entry`` (as kiln.toml spells it) stands for; ValueError naming what is wrong with it."""
    if isinstance(entry, str):
        if not entry:
            raise ValueError("an exclude pattern is empty: give a shell-style pattern over cell names")
        return Exclusion({}, entry)
    unknown = sorted(set(entry) - set(AXIS_KEYS))
    if unknown:
        raise ValueError(f"an exclude entry names {unknown}, not an axis: the axes are {list(AXIS_KEYS)}")
    if not entry:
        raise ValueError("an exclude entry names no axis: give python, torch, cuda, platform or several"
                         " (e.g. {python = \"3.13\", torch = \"2.13.0\"}), or a pattern over cell names")
    return Exclusion(dict(entry))


def check_exclusion(entry: str | dict[str, str]) -> str | dict[str, str]:
    """``entry`` as written, once :func:`exclusion` takes it (the model keeps kiln.toml's spelling)."""
    exclusion(entry)
    return entry


class Cell(_Model):
    """What one expanded variant stands for: ``matrix`` is the ``[[variants]]`` name it came from, ``values``
    its value of each axis the variant has (:data:`~kiln.tasks.project.config_axes.AXES`)."""

    matrix: str
    values: dict[str, str] = {}  # axis key -> the cell's value, e.g. {"python": "3.12", "cuda": "12.8"}
    label: str
    # abi = "stable" with a torch axis: every torch of the axis, which its one wheel (built against the newest)
    # claims; the test stage runs its suites under each
    claims: tuple[str, ...] = ()

    def value(self, key: str) -> str | None:
        return self.values.get(key)

    @property
    def python(self) -> str | None:
        """The cell's Python (e.g. "3.12")."""
        return self.values.get("python")

    @property
    def torch(self) -> str | None:
        """The cell's torch release (e.g. "2.14.1")."""
        return self.values.get("torch")


def axis_values(variant: Variant) -> dict[str, tuple[str, ...]]:
    """The axes ``variant`` has, each with its values, in table order (``platform`` only when it names several)."""
    have = {a.key: tuple(getattr(variant, a.key)) for a in AXES}
    return {key: values for key, values in have.items() if values and (key != "platform" or len(values) > 1
                                                                       or "platform" in variant.model_fields_set)}


def check_exclusions(variant: Variant) -> None:
    """Each exclusion names values of the axes the variant has (a typo would silently exclude nothing)."""
    have = axis_values(variant)
    for index, entry in enumerate(variant.exclude):
        for key, value in exclusion(entry).values.items():
            values = have.get(key, ())
            if value not in values:
                said = f"the variant's {key} axis is {list(values)}" if values else f"the variant has no {key} axis"
                raise ValueError(f"exclude[{index}].{key} = {value!r} matches no cell: {said}")


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
    """Whether ``variant`` is a matrix of cells: an axis of the table, or several CPUs."""
    return any(getattr(variant, a.key) for a in AXES if a.key != "platform") or len(variant.platform) > 1


def cell_name(variant: str, values: Mapping[str, str], axes: Mapping[str, Sequence[str]]) -> str:
    """``variant`` followed by each axis's fragment of the cell's value, in table order (``cpupy312torch2141``)."""
    return variant + "".join(a.fragment(values[a.key], axes[a.key]) for a in AXES if a.key in values)


def _label(variant: str, values: Mapping[str, str], axes: Mapping[str, Sequence[str]]) -> str:
    return variant + "".join(a.label(values[a.key], axes[a.key]) for a in AXES if a.key in values)


def _with_torch(requirements: Sequence[str], torch: str) -> tuple[str, ...]:
    kept = [r for r in requirements if canonicalize_name(Requirement(r).name) != "torch"]
    return (*kept, f"torch=={torch}")


def _stable_once(variant: Variant) -> Variant:
    """An ``abi = "stable"`` variant builds once per Python, not once per torch: against the newest torch of its
    axis, targeting the oldest (its ``torch_target`` unless it declares one), so its one wheel requires
    ``torch>=<oldest>`` and loads under each (:mod:`kiln.tasks.wheel.stable_abi`)."""
    oldest = Version(variant.torch[0]).release  # the torch axis's check sorted it
    target = variant.torch_target or f"{oldest[0]}.{oldest[1]}"
    return variant.model_copy(update={"torch": variant.torch[-1:], "torch_target": target})


def _cell(variant: Variant, name: str, values: dict[str, str], axes: Mapping[str, Sequence[str]],
          claims: tuple[str, ...]) -> Variant:
    """The variant of one cell (``name``): no axis of its own but the CPU it keeps, its cell and its torch."""
    update: dict[str, object] = {a.key: () for a in AXES if not a.keeps}
    update |= {"name": name, "exclude": (), "select": (),
               "cell": Cell(matrix=variant.name, values=values, label=_label(variant.name, values, axes),
                            claims=claims)}
    update |= {a.key: (values[a.key],) for a in AXES if a.keeps and a.key in values}
    if "torch" in values:
        update["build_requires"] = _with_torch(variant.build_requires, values["torch"])
    return variant.model_copy(update=update)


def expand(variant: Variant) -> tuple[Variant, ...]:
    """The variant's cells in axis order (:data:`~kiln.tasks.project.config_axes.AXES`), exclusions left out;
    itself without axes.

    A variant of several CPUs (``platform = ["x86_64", "aarch64"]``) is expanded with its axes: one cell per CPU
    of each of its other cells, each with that CPU alone, the same label (its wheels differ by platform tag, so
    they share the variant's index) and a name that says the CPU (:func:`cell_name`)."""
    if not has_axes(variant):
        return selected(variant, (variant,))
    claims: tuple[str, ...] = ()
    if variant.abi == "stable" and len(variant.torch) > 1:
        claims = tuple(variant.torch)
        variant = _stable_once(variant)
    axes = axis_values(variant)  # the variant's model checked its exclusions against them (check_exclusions)
    exclusions = [exclusion(entry) for entry in variant.exclude]
    cells = []
    for combination in itertools.product(*axes.values()):
        values = dict(zip(axes, combination, strict=True))
        name = cell_name(variant.name, values, axes)
        if not any(entry.matches(name, values) for entry in exclusions):
            cells.append(_cell(variant, name, values, axes, claims))
    if not cells:
        said = " x ".join(f"{key} {list(values)}" for key, values in axes.items())
        raise ValueError(f"variant {variant.name!r}: its exclude list leaves no cell of {said}; remove an"
                         " exclusion or the variant")
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
        wanted = (pinned_version(variant.build_requires) or host, at_target)
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
