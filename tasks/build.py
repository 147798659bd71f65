"""The build stage's plan and its compile units (no Prefect here).

:func:`plan_build` turns ``kiln.toml`` and the kernel registry into the
matrix variant × kernel × specialization × arch, with every skip and its
reason. :func:`build_unit` builds one unit through the content-addressed
cache: a verified hit is copied out; a miss compiles in a worker, checks the
binary's ELF arch against the plan, stores it and copies it out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from release.errors import CacheDriftError, CompileError, KilnError
from release.fsutil import atomic_write_bytes, sha256_bytes
from release.manifest import Unit
from tasks import archs as arch_rules
from tasks.cache import BuildCache, digest
from tasks.config import KilnConfig, Variant
from tasks.sources import source_closure
from tasks.triton_aot import check_elf_arch
from tasks.compile_pool import WorkerPool, WorkerTimeout

_log = logging.getLogger("kiln.build")

# Bump when the layout of cached artifacts changes: old entries then miss.
CACHE_FORMAT = "kiln-build-1"
BINARY_KIND = {"cuda": "cubin", "hip": "hsaco"}


@dataclass(frozen=True)
class CompileUnit:
    id: str
    variant: str
    backend: Literal["cuda", "hip"]
    arch: str
    requested: str
    kernel: str
    entry: str
    specialization: str
    kind: Literal["triton", "nvcc"]
    batch: str
    key: str
    archs: tuple[str, ...] = ()  # nvcc: every arch in the -gencode list


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
    config_path: str
    toolchain: dict[str, str]
    variants: tuple[VariantPlan, ...]

    @property
    def units(self) -> list[CompileUnit]:
        return [u for v in self.variants for u in v.units]

    @property
    def skips(self) -> list[Skip]:
        return [s for v in self.variants for s in v.skips]


def _fn_module(fn: Any) -> str:
    return getattr(getattr(fn, "fn", fn), "__module__", "")


def kernel_source_hash(config: KilnConfig, spec: Any) -> str:
    """Hash of the kernel's module, the modules of its Triton functions, what
    they import from the package, and its CUDA sources."""
    package_dir = config.path(config.project.source)
    package = config.project.package
    modules = {spec.module} | {_fn_module(e.fn) for e in spec.triton if _fn_module(e.fn).startswith(package)}
    files = sorted({p for m in modules for p in source_closure(package_dir, package, m)})
    if spec.csrc is not None:
        files += sorted(package_dir / s for s in spec.csrc.sources)
    parts = [f"{p.relative_to(package_dir).as_posix()}:{digest(p.read_bytes().hex())}" for p in files]
    return digest(*parts)


def _below_min(backend: str, arch: str, minimum: str | None) -> bool:
    if not minimum:
        return False
    if backend == "cuda":
        have, want = arch_rules.parse_cuda_arch(arch), arch_rules.parse_cuda_arch(minimum)
        return (have.major, have.minor) < (want.major, want.minor)
    # gfx names are hexadecimal-ish version numbers: gfx90a < gfx942 < gfx950 < gfx1100.
    return int(arch[3:], 16) < int(minimum[3:], 16)


def _triton_units(variant: Variant, spec: Any, resolved: tuple, batch: str) -> tuple[list[CompileUnit], list[Skip]]:
    units, skips = [], []
    for entry in spec.triton:
        for special in entry.specializations:
            for target in resolved:
                uid = f"build/{variant.name}/{target.arch}/{spec.name}/{special.name}"
                if variant.backend not in special.backends:
                    skips.append(Skip(uid, variant.name, spec.name, f"specialization {special.name!r} is only for {list(special.backends)}", target.arch))
                    continue
                minimum = special.min_arch.get(variant.backend)
                if _below_min(variant.backend, target.arch, minimum):
                    skips.append(Skip(uid, variant.name, spec.name, f"specialization {special.name!r} needs {variant.backend} arch >= {minimum}", target.arch))
                    continue
                key = digest(batch, entry.name, repr(sorted(special.signature.items())), repr(sorted(special.constexprs.items())),
                             repr(sorted((getattr(special, "options", {}) or {}).items())),
                             repr(tuple(getattr(special, "aligned", ()) or ())), variant.backend, target.arch)
                units.append(CompileUnit(uid, variant.name, variant.backend, target.arch, target.requested, spec.name,  # type: ignore[arg-type]
                                         entry.name, special.name, "triton", batch, key))
    return units, skips


def _nvcc_unit(variant: Variant, spec: Any, batch: str, nvcc_missing: str) -> tuple[list[CompileUnit], list[Skip]]:
    csrc = spec.csrc
    resolved = arch_rules.resolve_cuda(variant.archs, csrc.supported)
    reason = "" if resolved else arch_rules.skip_reason(spec.name, "cuda", variant.archs, csrc.supported)
    if reason or nvcc_missing:
        return [], [Skip(f"build/{variant.name}/-/{spec.name}/{csrc.name}", variant.name, spec.name, reason or nvcc_missing)]
    archs = tuple(r.arch for r in resolved)
    label = "+".join(arch_rules.parse_cuda_arch(a).sm for a in archs)
    key = digest(batch, csrc.name, csrc.library, *archs)
    return [CompileUnit(f"build/{variant.name}/{label}/{spec.name}/{csrc.name}", variant.name, "cuda", ",".join(archs),
                        ",".join(variant.archs), spec.name, csrc.library, csrc.name, "nvcc", batch, key, archs)], []


def plan_variant(config: KilnConfig, variant: Variant, specs: list[Any], toolchain: dict[str, str],
                 nvcc_missing: str = "") -> VariantPlan:
    units: list[CompileUnit] = []
    skips: list[Skip] = []
    if variant.backend == "cpu":
        return VariantPlan(variant.name, variant.backend, (), ())
    tools = sorted(toolchain.items())
    for spec in specs:
        supported = tuple(spec.supported.get(variant.backend, ()))
        batch = digest(CACHE_FORMAT, spec.name, variant.backend, kernel_source_hash(config, spec), repr(tools))[:32]
        resolved = arch_rules.resolve(variant.backend, variant.archs, supported) if spec.triton else ()
        if spec.triton and not resolved:
            reason = arch_rules.skip_reason(spec.name, variant.backend, variant.archs, supported)
            skips.append(Skip(f"build/{variant.name}/-/{spec.name}/-", variant.name, spec.name, reason))
        more_units, more_skips = _triton_units(variant, spec, resolved, batch)
        units += more_units
        skips += more_skips
        if spec.csrc is not None and variant.backend == "cuda":
            more_units, more_skips = _nvcc_unit(variant, spec, batch, nvcc_missing)
            units += more_units
            skips += more_skips
    return VariantPlan(variant.name, variant.backend, tuple(units), tuple(skips))


def plan_build(config: KilnConfig, specs: list[Any], config_path: str, toolchain: dict[str, str],
               variants: list[str] | None = None, nvcc_missing: str = "") -> BuildPlan:
    """The full matrix for ``variants`` (all of kiln.toml's when ``None``); pure.

    ``nvcc_missing``: why CUDA C++ units cannot build (they become skips), or "".
    """
    chosen = [config.variant(name) for name in variants] if variants else list(config.variants)
    return BuildPlan(str(Path(config_path).resolve()), dict(toolchain),
                     tuple(plan_variant(config, v, specs, toolchain, nvcc_missing) for v in chosen))


# --- building one unit ---------------------------------------------------------


@dataclass
class BuildEnv:
    """What every unit of one build needs; shared by the units of a run."""

    config_path: str
    out_dir: Path  # <out>/build
    cache: BuildCache
    pool: WorkerPool
    timeout_s: float
    toolchain: dict[str, str]
    nvcc: Any = None  # tasks.nvcc.Nvcc, or None when nvcc is missing
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class UnitResult:
    unit_id: str
    cache: Literal["hit", "miss"]
    duration_s: float
    files: tuple[Path, ...]  # written under BuildEnv.out_dir
    entries: tuple[dict[str, Any], ...]  # _aot/manifest.json rows (path relative to the variant dir)
    size: int


def unit_dir(unit: CompileUnit) -> str:
    """Where a unit's files go, relative to the variant's directory (and to ``<package>/_aot/``).

    The shared library sits at the top, where the package's loader looks for it.
    """
    return "." if unit.kind == "nvcc" else f"{unit.arch}/{unit.kernel}"


def _compile_triton(unit: CompileUnit, env: BuildEnv) -> dict[str, bytes]:
    request = {"config": env.config_path, "kernel": unit.kernel, "entry": unit.entry,
               "specialization": unit.specialization, "backend": unit.backend, "arch": unit.arch}
    what = f"kernel {unit.kernel!r} specialization {unit.specialization!r} for {unit.backend} {unit.arch} (variant {unit.variant})"
    _log.info("compiling %s", what)
    try:
        result = env.pool.call("tasks.triton_aot:compile_in_worker", request, env.timeout_s)
    except WorkerTimeout as exc:
        raise CompileError(f"{what}: compile did not finish within {env.timeout_s:g} s; worker {exc.ladder}") from exc
    except RuntimeError as exc:
        raise CompileError(f"{what}: Triton failed to compile: {exc}") from exc
    check_elf_arch(result["binary"], unit.backend, unit.arch, what)
    kind = BINARY_KIND[unit.backend]
    name = f"{unit.entry}__{unit.specialization}"
    return {f"{name}.{kind}": result["binary"], f"{name}.json": result["metadata"]}


def _compile(unit: CompileUnit, env: BuildEnv) -> dict[str, bytes]:
    if unit.kind == "triton":
        return _compile_triton(unit, env)
    if env.nvcc is None:
        raise CompileError(f"{unit.id}: nvcc is not available")
    return env.nvcc.build_unit(unit, env)


def _entries(unit: CompileUnit, files: dict[str, bytes], written: list[Path], env: BuildEnv) -> list[dict[str, Any]]:
    kind = {"cubin": "cubin", "hsaco": "hsaco", "so": "shared-library"}
    variant_dir = (env.out_dir / unit.variant).resolve()
    rows = []
    for (name, data), path in zip(files.items(), written):
        suffix = name.rsplit(".", 1)[-1]
        if suffix not in kind:
            continue  # Triton's metadata JSON travels beside its binary, unlisted
        rows.append({"kernel": unit.kernel, "entry": unit.entry, "specialization": unit.specialization,
                     "arch": unit.arch, "kind": kind[suffix], "path": path.relative_to(variant_dir).as_posix(),
                     "sha256": sha256_bytes(data), "size": len(data), "toolchain": dict(env.toolchain)})
    return rows


def build_unit(unit: CompileUnit, env: BuildEnv) -> UnitResult:
    """Build one unit (cache hit or compile) and write its files under ``env.out_dir``.

    Raises :class:`CompileError` (permanent) with the compiler's message,
    :class:`CacheDriftError` (retryable; the batch is already invalidated) or
    :class:`InfrastructureError` (retryable; a worker died).
    """
    start = time.perf_counter()
    try:
        hit = env.cache.get(unit.batch, unit.key)
    except CacheDriftError as exc:
        env.events.append(f"{unit.id}: {exc}")
        raise
    if hit is not None:
        files, cache = hit.files, "hit"
    else:
        files, cache = _compile(unit, env), "miss"
        env.cache.put(unit.batch, unit.key, files, {"unit": unit.id, "toolchain": env.toolchain})
    directory = (env.out_dir / unit.variant / unit_dir(unit)).resolve()
    written = []
    for name, data in files.items():
        atomic_write_bytes(directory / name, data)
        written.append(directory / name)
    entries = _entries(unit, files, written, env)
    return UnitResult(unit.id, cache, time.perf_counter() - start, tuple(written), tuple(entries),  # type: ignore[arg-type]
                      sum(e["size"] for e in entries))


def unit_record(unit: CompileUnit, outcome: UnitResult | BaseException) -> Unit:
    """The run-manifest row for a unit, from its result or the error it ended with."""
    base = dict(id=unit.id, stage="build", variant=unit.variant, arch=unit.arch, kernel=unit.kernel)
    if isinstance(outcome, UnitResult):
        return Unit(**base, state="completed", duration_s=outcome.duration_s, cache=outcome.cache,  # type: ignore[arg-type]
                    message=f"{outcome.size} bytes")
    kind = type(outcome).__name__ if isinstance(outcome, KilnError) else f"unexpected {type(outcome).__name__}"
    return Unit(**base, state="failed", message=f"{kind}: {outcome}")  # type: ignore[arg-type]


def skip_record(skip: Skip) -> Unit:
    return Unit(id=skip.id, stage="build", state="skipped", variant=skip.variant, arch=skip.arch,
                kernel=skip.kernel, message=skip.reason)


def verify_cache(plan: BuildPlan, cache: BuildCache) -> list[str]:
    """Check every cache entry the plan will read; drifted batches are invalidated
    before any unit starts, so all their units rebuild in this run. Returns the events."""
    batches: dict[str, list[str]] = {}
    for unit in plan.units:
        batches.setdefault(unit.batch, []).append(unit.key)
    return [e for batch, keys in sorted(batches.items()) if (e := cache.verify(batch, keys))]

