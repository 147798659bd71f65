"""The build stage's plan (pure, no Prefect here).

:func:`plan_build` turns ``kiln.toml`` and the kernel registry into the
matrix variant × kernel × specialization × arch, with every skip and its
reason. Building one unit is :mod:`kiln.tasks.build.units`.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import Requirement

from kiln.core.fsutil import digest
from kiln.runtime.archs import at_least
from kiln.tasks.build.reproducible import BUILD_RECIPE
from kiln.tasks.build.sources import project_hash, source_closure
from kiln.tasks.project import archs as arch_rules
from kiln.tasks.project.config import KilnConfig, Variant
from kiln.tasks.project.config_axes import AXES
from kiln.tasks.project.registry_types import CudaSourceRecord, KernelRecord, OpaqueValue, SpecializationRecord

# Bump when the layout of cached artifacts changes: old entries then miss.
CACHE_FORMAT = "kiln-build-1"


@dataclass(frozen=True)
class CompileUnit:
    id: str
    variant: str
    backend: Literal["cuda", "hip", "cpu"]  # cpu: only a pep517 unit (the project's own build of the cpu wheel)
    arch: str
    requested: str
    kernel: str
    entry: str
    specialization: str
    kind: Literal["triton", "nvcc", "pep517"]
    batch: str
    key: str
    archs: tuple[str, ...] = ()  # nvcc: every arch in the -gencode list; pep517: the variant's archs
    # Triton: what the shipped loader needs to rebuild a launchable kernel (JSON: signature,
    # constexprs, aligned), written into the manifest row of the unit's binary.
    launch: str = ""
    arch_policy: str = "exact"  # pep517: what the wheel must hold of ``archs`` (kiln.toml's variant arch_policy)


@dataclass(frozen=True)
class Skip:
    id: str
    variant: str
    kernel: str
    reason: str
    arch: str | None = None


@dataclass(frozen=True)
class VariantPlan:
    name: str
    backend: str
    units: tuple[CompileUnit, ...]
    skips: tuple[Skip, ...]


@dataclass(frozen=True)
class BuildPlan:
    toolchain: dict[str, str]
    variants: tuple[VariantPlan, ...]

    @property
    def units(self) -> list[CompileUnit]:
        return [u for v in self.variants for u in v.units]

    @property
    def skips(self) -> list[Skip]:
        return [s for v in self.variants for s in v.skips]

    def in_start_order(self) -> list[CompileUnit]:
        """The units in the order to start them: the long ones first, the rest in plan order.

        A project build or an nvcc build runs for seconds to minutes in a thread of its own,
        beside the Triton units that share the compile pool. Started in plan order (after its
        kernel's Triton units), the default project's nvcc unit was the last to finish in every
        cold build, alone for its last 4.5-7 s with a core idle.
        """
        return sorted(self.units, key=lambda unit: unit.kind == "triton")


def kernel_source_hash(config: KilnConfig, spec: KernelRecord) -> str:
    """Hash of the kernel's module, the modules of its Triton functions, what
    they import from the package, and its CUDA sources."""
    package_dir = config.path(config.project.source)
    package = config.project.package
    modules = {spec.module} | {e.fn_module for e in spec.triton if e.fn_module.startswith(package)}
    files = sorted({p for m in modules for p in source_closure(package_dir, package, m)})
    if spec.csrc is not None:
        sources = [package_dir / s for s in spec.csrc.sources]
        # The headers beside the sources are inputs too (an edited .h must rebuild the library).
        headers = {h for s in sources for h in s.parent.iterdir() if h.suffix in (".h", ".hpp", ".cuh")}
        files += sorted(set(sources) | headers)
    parts = [f"{p.relative_to(package_dir).as_posix()}:{digest(p.read_bytes().hex())}" for p in files]
    return digest(*parts)


def _below_min(backend: str, arch: str, minimum: str | None) -> bool:
    """True when ``arch`` is older than the specialization's ``minimum`` (the rule the kernels apply at run time)."""
    if not minimum:
        return False
    return not at_least(backend, arch, arch_rules.validate_arch(minimum, backend))


def launch_info(special: SpecializationRecord) -> str:
    """The manifest's launch fields of a specialization, or "" when a constexpr is not a JSON scalar
    (the loader then JITs that one)."""
    scalars = all(isinstance(v, (bool, int, float, str)) or v is None
                  or (isinstance(v, OpaqueValue) and v.scalar is not None) for v in special.constexprs.values())
    if not scalars:
        return ""
    return json.dumps({"signature": dict(special.signature), "constexprs": dict(special.constexprs),
                       "aligned": list(special.aligned)}, sort_keys=True, default=_scalar)


def _scalar(value: Any) -> Any:
    """The JSON form of a derived scalar the registry's guest sent as an :class:`OpaqueValue`."""
    if isinstance(value, OpaqueValue):
        return value.scalar
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def toolchain_axes(variant: Variant) -> tuple[str, ...]:
    """The cell's values of the axes that change its compilers (``cuda=12.8``): in its Triton units' keys, so
    each CUDA release's kernels are compiled and cached apart; () otherwise (keys as before the axis)."""
    if variant.cell is None:
        return ()
    return tuple(f"{a.key}={variant.cell.value(a.key)}" for a in AXES if a.toolchain and variant.cell.value(a.key))


def _triton_units(variant: Variant, spec: KernelRecord, resolved: tuple[Any, ...],
                  batch: str) -> tuple[list[CompileUnit], list[Skip]]:
    units: list[CompileUnit] = []
    skips: list[Skip] = []
    for entry in spec.triton:
        for special in entry.specializations:
            for target in resolved:
                uid = f"build/{variant.name}/{target.arch}/{spec.name}/{special.name}"
                if variant.backend not in special.backends:
                    skips.append(Skip(uid, variant.name, spec.name,
                                      f"specialization {special.name!r} is only for {list(special.backends)}",
                                      target.arch))
                    continue
                minimum = special.min_arch.get(variant.backend)
                if _below_min(variant.backend, target.arch, minimum):
                    skips.append(Skip(uid, variant.name, spec.name,
                                      f"specialization {special.name!r} needs {variant.backend} arch >= {minimum}",
                                      target.arch))
                    continue
                key = digest(batch, entry.name, repr(sorted(special.signature.items())),
                             repr(sorted(special.constexprs.items())), repr(sorted(special.options.items())),
                             repr(special.aligned), variant.backend, target.arch, *toolchain_axes(variant))
                units.append(CompileUnit(uid, variant.name, variant.backend, target.arch, target.requested, spec.name,
                                         entry.name, special.name, "triton", batch, key, launch=launch_info(special)))
    return units, skips


def _nvcc_unit(variant: Variant, kernel: str, csrc: CudaSourceRecord, batch: str,
               nvcc_missing: str, toolchain: str) -> tuple[list[CompileUnit], list[Skip]]:
    resolved = arch_rules.resolve_cuda(variant.archs, csrc.supported)
    reason = "" if resolved else arch_rules.skip_reason(kernel, "cuda", variant.archs, csrc.supported)
    if reason or nvcc_missing:
        return [], [Skip(f"build/{variant.name}/-/{kernel}/{csrc.name}", variant.name, kernel, reason or nvcc_missing)]
    archs = tuple(r.arch for r in resolved)
    skips = unsupported_archs(variant, kernel, csrc.supported, csrc.name) if not nvcc_missing else []
    label = "+".join(arch_rules.parse_cuda_arch(a).sm for a in archs)
    key = digest(batch, csrc.name, csrc.library, toolchain, *archs, *filter(None, [variant_env_id(variant)]))
    return [CompileUnit(f"build/{variant.name}/{label}/{kernel}/{csrc.name}", variant.name, "cuda", ",".join(archs),
                        ",".join(variant.archs), kernel, csrc.library, csrc.name, "nvcc", batch, key, archs)], skips


def unsupported_archs(variant: Variant, kernel: str, supported: Sequence[str], what: str) -> list[Skip]:
    """A skip for every requested arch ``supported`` does not cover, when some other arch is covered
    (a kernel that covers none is one skip of its own): a dropped arch is never silent."""
    missing = [a for a in variant.archs if not arch_rules.resolve(variant.backend, [a], supported)]
    if len(missing) == len(variant.archs):
        return []
    return [Skip(f"build/{variant.name}/{arch}/{kernel}/{what}", variant.name, kernel,
                 f"kernel {kernel!r} does not support {variant.backend} arch {arch} (its {what} supports"
                 f" {list(supported)}); the {variant.name} wheel has no {kernel} binary for it", arch)
            for arch in missing]


def kiln_state(config: KilnConfig) -> tuple[Path, ...]:
    """Kiln's own state inside a project (the build cache; ``.kiln/`` and ``--out`` are found by
    :func:`kiln.tasks.build.sources.project_files`): never hashed, never copied into a project build."""
    return (config.path(config.build.cache_dir),)


def variant_env_id(variant: Variant) -> str:
    """What the variant's build environment adds to its native units' keys ("" without one: keys as before)."""
    if not variant.build_requires and not variant.build_env and variant.cell is None:
        return ""
    # The requirements as kiln.tasks.build.buildenv keys its environment (sorted, canonical), and the interpreter.
    requirements = sorted(str(Requirement(r)) for r in variant.build_requires)
    # A matrix cell: its Python (and torch, in the requirements) and its wheel's label (invariant 13).
    cell = [] if variant.cell is None else ["cell", variant.cell.model_dump_json()]
    return digest("build-env", platform.python_version() if not cell else "", *requirements, "",
                  *(f"{k}={v}" for k, v in sorted(variant.build_env.items())), *cell)


def _project_input(config: KilnConfig, variant: Variant, project: Path) -> str:
    """The project's hash for a backend unit. A matrix cell's leaves kiln.toml out: what of it the build sees
    (the variant's archs, toolchain, build environment, policy and cell) is in the unit's key, so a Python added
    to the axis builds that cell alone, not every cell again. A variant without axes: as before."""
    if variant.cell is None:
        return project_hash(project, kiln_state(config))
    config_file = os.path.relpath(config.config_file, project)
    return project_hash(project, kiln_state(config), unhashed=(Path(config_file).as_posix(),))


def backend_unit(config: KilnConfig, variant: Variant, toolchain: dict[str, str]) -> CompileUnit:
    """The variant's whole wheel, built by the project's own backend (``[build] backend = "pep517"``)."""
    archs = variant.archs
    # A pure-Triton package's wheel holds no device code, and any it vendors is its own: none refused.
    policy = "record" if config.build.kind == "triton-jit" else variant.arch_policy
    label = "+".join(arch_rules.parse_cuda_arch(a).sm if variant.backend == "cuda" else a for a in archs) or "-"
    project = config.path(config.build.project_dir)
    batch = digest(CACHE_FORMAT, "pep517", BUILD_RECIPE, variant.backend, _project_input(config, variant, project),
                   repr(sorted(toolchain.items())))[:32]
    key = digest(batch, variant.name, *archs, config.build.toolchain.model_dump_json(),
                 *([variant_env_id(variant), policy] if variant_env_id(variant) or policy != "exact" else []),
                 *(["abi", variant.abi, variant.torch_target or "-"] if variant.abi != "exact" else []))
    name = config.project.distribution
    return CompileUnit(f"build/{variant.name}/{label}/{name}/pep517", variant.name, variant.backend,
                       ",".join(archs) or "-", ",".join(archs), name, "pep517", "wheel", "pep517", batch, key, archs,
                       arch_policy=policy)


def plan_variant(config: KilnConfig, variant: Variant, specs: Sequence[KernelRecord], toolchain: dict[str, str],
                 nvcc_missing: str = "") -> VariantPlan:
    # The project's own build comes first: Kiln's AOT units (a registry beside it) only add to its wheel.
    units: list[CompileUnit] = [backend_unit(config, variant, toolchain)] if config.build.backend == "pep517" else []
    skips: list[Skip] = []
    if variant.backend == "cpu":
        return VariantPlan(variant.name, variant.backend, tuple(units), ())
    tools = sorted(toolchain.items())
    for spec in specs:
        supported = tuple(spec.supported.get(variant.backend, ()))
        batch = digest(CACHE_FORMAT, spec.name, variant.backend, kernel_source_hash(config, spec), repr(tools))[:32]
        resolved = arch_rules.resolve(variant.backend, variant.archs, supported) if spec.triton else ()
        if spec.triton and not resolved:
            reason = arch_rules.skip_reason(spec.name, variant.backend, variant.archs, supported)
            skips.append(Skip(f"build/{variant.name}/-/{spec.name}/-", variant.name, spec.name, reason))
        elif spec.triton:
            skips += unsupported_archs(variant, spec.name, supported, "triton")
        more_units, more_skips = _triton_units(variant, spec, resolved, batch)
        units += more_units
        skips += more_skips
        if spec.csrc is not None and variant.backend == "cuda":
            more_units, more_skips = _nvcc_unit(variant, spec.name, spec.csrc, batch, nvcc_missing,
                                                config.build.toolchain.model_dump_json())
            units += more_units
            skips += more_skips
    return VariantPlan(variant.name, variant.backend, tuple(units), tuple(skips))


def plan_build(config: KilnConfig, specs: Sequence[KernelRecord], toolchain: dict[str, str],
               variants: list[str] | None = None, nvcc_missing: str = "") -> BuildPlan:
    """The full matrix for ``variants`` (all of kiln.toml's when ``None``); pure.

    ``specs``: the records :func:`kiln.tasks.project.registry.load_registry` returns.

    ``nvcc_missing``: why CUDA C++ units cannot build (they become skips), or "".
    """
    chosen = [config.variant(name) for name in variants] if variants else list(config.variants)
    return BuildPlan(dict(toolchain),
                     tuple(plan_variant(config, v, specs, toolchain, nvcc_missing) for v in chosen))
