"""The witness: every wheel built again with every cache bypassed, and compared byte for byte.

A cache tier (the worker's units, the team's shared tier, the compile cache) may be stale, corrupt or forged
and still pass its own checks when whoever forged an entry also forged its hash. Builds are byte-reproducible
(invariant 8), so a second build of the same plan from nothing — a fresh unit cache, no shared tier, an empty
compile cache, fresh compile workers — must give the same bytes; a wheel that differs names its members, and
the build that claims it is refused. ``kiln build --witness`` and every release build run it.
"""

from __future__ import annotations

import logging
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from kiln.core.fsutil import sha256_file
from kiln.tasks.build import units as build_units
from kiln.tasks.build.compile_cache import bypassed
from kiln.tasks.build.stage import BuildSetup, assemble_variant, compile_context
from kiln.tasks.build.units import UnitResult

log = logging.getLogger(__name__)

_SHOWN = 8  # differing members named per wheel


@dataclass(frozen=True)
class Witnessed:
    """What the bypassed build said of each wheel: identical, or the members that differ."""

    identical: tuple[str, ...]
    differing: dict[str, tuple[str, ...]]  # wheel name -> its members with other bytes (or only in one)
    missing: tuple[str, ...]  # wheels the bypassed build did not make

    @property
    def ok(self) -> bool:
        return not self.differing and not self.missing

    def message(self) -> str:
        if self.ok:
            return f"witnessed: {len(self.identical)} wheels identical with every cache bypassed"
        parts = [f"{name}: {', '.join(members[:_SHOWN])}" + (f" and {len(members) - _SHOWN} more"
                                                             if len(members) > _SHOWN else "")
                 for name, members in sorted(self.differing.items())]
        parts += [f"{name}: not built again" for name in self.missing]
        return (f"the witness refuses: {len(self.differing) + len(self.missing)} wheels differ from a build with "
                f"every cache bypassed (a cache served other bytes; nothing built from it may be released) — "
                + "; ".join(parts))


def differing_members(one: Path, other: Path) -> tuple[str, ...]:
    """The members of two wheels whose bytes differ, or that only one holds."""
    with zipfile.ZipFile(one) as a, zipfile.ZipFile(other) as b:
        names = sorted(set(a.namelist()) | set(b.namelist()))
        return tuple(n for n in names if n not in a.namelist() or n not in b.namelist() or a.read(n) != b.read(n))


def rebuild(setup: BuildSetup, work: Path) -> dict[str, Path]:
    """Every wheel of ``setup``'s plan built again under ``work`` with no cache to read: name -> path."""
    # an empty compile cache too, with no shared tier: the build's own would serve its (maybe planted) objects
    fresh = bypassed(setup.nvcc.cache if setup.nvcc is not None else
                     setup.project.compile_cache if setup.project is not None else None, work / "cache")
    bare = replace(setup, cache_root=work / "cache", remote=None,
                   nvcc=replace(setup.nvcc, cache=fresh) if setup.nvcc is not None else None,
                   project=replace(setup.project, compile_cache=fresh) if setup.project is not None else None)
    out = work / "out"
    outcomes: dict[str, UnitResult | BaseException] = {}
    with compile_context(bare, out) as env:
        for unit in bare.plan.in_start_order():
            try:
                outcomes[unit.id] = build_units.build_unit(unit, env)
            except Exception as exc:  # the unit's own build said why; the wheel it feeds is then missing
                log.warning("witness: unit %s failed when built again: %s", unit.id, exc)
                outcomes[unit.id] = exc
    wheels: dict[str, Path] = {}
    for variant in bare.plan.variants:
        output = assemble_variant(bare, variant, {u.id: outcomes[u.id] for u in variant.units}, out)
        wheels.update({path.name: path for path, kind in output.files if kind == "wheel"})
    return wheels


def witness(setup: BuildSetup, wheels: Iterable[Path]) -> Witnessed:
    """Build ``setup``'s plan again with every cache bypassed and compare each of ``wheels`` with it."""
    with tempfile.TemporaryDirectory(prefix="kiln-witness-") as tmp:
        again = rebuild(setup, Path(tmp))
        identical, differing, missing = [], {}, []
        for wheel in wheels:
            twin = again.get(wheel.name)
            if twin is None:
                missing.append(wheel.name)
            elif sha256_file(twin) == sha256_file(wheel):
                identical.append(wheel.name)
            else:
                differing[wheel.name] = differing_members(wheel, twin)
    found = Witnessed(tuple(sorted(identical)), differing, tuple(sorted(missing)))
    log.info("%s", found.message())
    return found


__all__ = ["Witnessed", "differing_members", "rebuild", "witness"]
