"""Building one compile unit (no Prefect here).

:func:`build_unit` builds one unit of the plan through the content-addressed
cache: a verified hit is copied out; a miss compiles in a worker, checks the
binary's ELF arch against the plan, stores it and copies it out. A compile is
timed, and its seconds kept in the unit's entry, so a later hit says what it saved
(:mod:`kiln.tasks.build.compile_seconds`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from kiln.core.entrypoints import load
from kiln.core.errors import CacheDriftError, CompileError, KilnError
from kiln.core.fsutil import atomic_write_bytes, sha256_bytes
from kiln.core.manifest import Unit
from kiln.tasks.build.aot import check_elf_arch
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.compile_cache import COMPILE_STATS, CompileStats
from kiln.tasks.build.compile_seconds import CompileSeconds, entry_info, measured, on_compile, on_hit
from kiln.tasks.build.plan import BuildPlan, CompileUnit, Skip
from kiln.tasks.build.pool import WorkerPool, WorkerTimeout
from kiln.tasks.project.config import KilnConfig, Variant
from kiln.tasks.project.config_axes import AXES

_log = logging.getLogger(__name__)

BINARY_KIND = {"cuda": "cubin", "hip": "hsaco"}



@dataclass
class CompileContext:
    """What every unit of one build needs; shared by the units of a run."""

    config_path: str  # the kiln.toml each compile worker loads in its own process (stage.worker_config)
    out_dir: Path  # <out>/build
    cache: BuildCache
    pool: WorkerPool
    timeout_s: float
    toolchain: dict[str, str]
    nvcc: Any = None  # kiln.tasks.build.nvcc.Nvcc, or None when nvcc is missing
    project: Any = None  # kiln.tasks.build.backend.ProjectBuilder, for [build] backend = "pep517"
    events: list[str] = field(default_factory=list)
    # kiln.tasks.build.buildenv.VariantEnvironments: each variant's build_requires environment, made on first use
    environments: Any = None
    config: KilnConfig | None = None  # a variant environment's nvcc settings come from it


@dataclass(frozen=True)
class UnitResult:
    unit_id: str
    cache: Literal["hit", "miss"]
    duration_s: float
    files: tuple[Path, ...]  # written under CompileContext.out_dir
    entries: tuple[dict[str, Any], ...]  # _aot/manifest.json rows (path relative to the variant dir)
    size: int
    device_code: str = ""  # pep517: the archs the wheel holds ("SASS ['sm_80']"), recorded in the run
    # A native unit compiled now: its translation units compiled and served by the compile cache.
    compile: CompileStats | None = None
    seconds: CompileSeconds = CompileSeconds()  # compile seconds spent now and saved by the caches


def unit_dir(unit: CompileUnit) -> str:
    """Where a unit's files go, relative to the variant's directory (and to ``<package>/_aot/``).

    The shared library sits at the top, where the package's loader looks for it.
    """
    return "." if unit.kind in ("nvcc", "pep517") else f"{unit.arch}/{unit.kernel}"


def cell_toolchain(variant: Variant | None) -> dict[str, str]:
    """The environment a cell's compilers run with, from each axis of the table that says how
    (:attr:`~kiln.tasks.project.config_axes.Axis.toolchain`: the ``cuda`` axis's ptxas); {} for any other."""
    if variant is None or variant.cell is None:
        return {}
    environ: dict[str, str] = {}
    for axis in AXES:
        value = variant.cell.value(axis.key)
        if axis.toolchain and value is not None:
            environ |= cast(Callable[[str], Mapping[str, str]], load(axis.toolchain))(value)
    return environ


def _compile_triton(unit: CompileUnit, env: CompileContext) -> dict[str, bytes]:
    variant = env.config.variant(unit.variant) if env.config is not None else None
    request = {"config": env.config_path, "kernel": unit.kernel, "entry": unit.entry,
               "specialization": unit.specialization, "backend": unit.backend, "arch": unit.arch,
               "environ": cell_toolchain(variant)}
    what = (f"kernel {unit.kernel!r} specialization {unit.specialization!r} for {unit.backend} {unit.arch} "
            f"(variant {unit.variant})")
    _log.info("compiling %s", what)
    try:
        # CompileError (Triton's failure, named by the worker), BuildWorkerError and
        # InfrastructureError come through as their own types.
        result = env.pool.call("kiln.tasks.build.aot:compile_in_worker", request, env.timeout_s)
    except WorkerTimeout as exc:
        raise CompileError(f"{what}: compile did not finish within {env.timeout_s:g} s; worker {exc.ladder}"
                           + (f"\n{exc.stacks}" if exc.stacks else "")) from exc
    check_elf_arch(result["binary"], unit.backend, unit.arch, what)
    kind = BINARY_KIND[unit.backend]
    name = f"{unit.entry}__{unit.specialization}"
    return {f"{name}.{kind}": result["binary"], f"{name}.json": result["metadata"]}


def _check_release(unit: CompileUnit, env: CompileContext) -> None:
    """Kiln's own nvcc units of a ``cuda`` axis cell build with this machine's nvcc, so only when it is the cell's
    release (a package's own build gets its cell's toolkit: :func:`kiln.tasks.build.cuda_toolkits.cell_cuda_home`,
    which names what it lacks)."""
    variant = env.config.variant(unit.variant) if env.config is not None else None
    release = variant.cell.value("cuda") if variant is not None and variant.cell is not None else None
    if release is None or unit.kind != "nvcc":
        return
    from kiln.tasks.build.cuda_toolkits import release_of

    have = release_of(env.nvcc.version) if env.nvcc is not None else None
    if have != release:
        raise CompileError(f"{unit.id}: the cell is for CUDA {release} and this machine's nvcc is "
                           f"{have or 'missing'}: Kiln's CUDA C++ kernels build only with CUDA {release}'s toolkit"
                           f" installed (its Triton kernels build anywhere); install it or drop {release} from"
                           f" the variant's cuda axis")


def _compile(unit: CompileUnit, env: CompileContext) -> tuple[dict[str, bytes], float]:
    """The unit's files and the seconds its builder took."""
    if unit.kind == "triton":
        return _timed(_compile_triton, unit, env)
    _check_release(unit, env)
    if unit.kind == "pep517":
        if env.project is None:
            raise CompileError(f"{unit.id}: kiln.toml's [build] backend is not 'pep517'")
        if env.environments is not None:
            # made once per variant (minutes) and shared by its units: not this unit's compile seconds
            env.environments.for_variant(unit.variant)
        return _timed(env.project.build_unit, unit, env)
    if env.nvcc is None:
        raise CompileError(f"{unit.id}: nvcc is not available")
    return _timed(_nvcc_builder(unit, env).build_unit, unit, env)


def _timed(build: Callable[[CompileUnit, CompileContext], dict[str, bytes]], unit: CompileUnit,
           env: CompileContext) -> tuple[dict[str, bytes], float]:
    start = time.perf_counter()
    files = build(unit, env)
    return files, measured(time.perf_counter() - start)


def _nvcc_builder(unit: CompileUnit, env: CompileContext) -> Any:
    """Kiln's nvcc builder, with the torch of the variant's own build environment when it has one."""
    made = env.environments.for_variant(unit.variant) if env.environments is not None else None
    if made is None or env.config is None:
        return env.nvcc
    from kiln.tasks.build.nvcc import settings_for

    settings = env.environments.settings(unit.variant, lambda e: settings_for(env.config, str(e.python)))
    return dataclasses.replace(env.nvcc, settings=settings)


def _device_code(files: dict[str, bytes]) -> tuple[dict[str, bytes], str]:
    """The unit's files less the pep517 unit's device-code record, and what that record says the wheel holds."""
    from kiln.tasks.build.backend import DEVICE_CODE

    if DEVICE_CODE not in files:
        return files, ""
    record = json.loads(files[DEVICE_CODE])
    dropped = f"; Kiln's nvcc dropped its build's own targets {record['dropped']}" if record.get("dropped") else ""
    return {n: d for n, d in files.items() if n != DEVICE_CODE}, f"holds {record['held']} ({record['policy']}){dropped}"


def _entries(unit: CompileUnit, files: dict[str, bytes], written: list[Path],
             env: CompileContext) -> list[dict[str, Any]]:
    kind = {"cubin": "cubin", "hsaco": "hsaco", "so": "shared-library"}
    variant_dir = (env.out_dir / unit.variant).resolve()
    rows = []
    for (name, data), path in zip(files.items(), written, strict=True):
        suffix = name.rsplit(".", 1)[-1]
        if suffix not in kind:
            continue  # Triton's metadata JSON travels beside its binary, unlisted
        row = {"kernel": unit.kernel, "entry": unit.entry, "specialization": unit.specialization,
               "arch": unit.arch, "kind": kind[suffix], "path": path.relative_to(variant_dir).as_posix(),
               "sha256": sha256_bytes(data), "size": len(data), "toolchain": dict(env.toolchain)}
        rows.append(row | (json.loads(unit.launch) if unit.launch and suffix != "so" else {}))
    return rows


def build_unit(unit: CompileUnit, env: CompileContext) -> UnitResult:
    """Build one unit (cache hit or compile) and write its files under ``env.out_dir``.

    Raises :class:`CompileError` (permanent) with the compiler's message,
    :class:`BuildWorkerError` (permanent; the worker failed before judging the
    unit: an import, the registry, a bug), :class:`CacheDriftError` (retryable;
    the batch is already invalidated) or :class:`InfrastructureError`
    (retryable; a worker died).
    """
    start = time.perf_counter()
    try:
        hit = env.cache.get(unit.batch, unit.key)
    except CacheDriftError as exc:
        env.events.append(f"{unit.id}: {exc}")
        raise
    if hit is not None:
        return _result(unit, env, hit.files, "hit", start, on_hit(hit.info))
    files, spent = _compile(unit, env)
    raw = files.pop(COMPILE_STATS, None)  # this compile's, never cached: a hit compiles nothing
    stats = None if raw is None else CompileStats.from_dict(json.loads(raw))
    partial = stats is not None and bool(stats.reused)
    seconds, full = on_compile(spent, partial, env.cache.full_compile_seconds(unit.id) if partial else None)
    if stats is not None and not partial:  # a unit without translation units (Triton) is never partial
        env.cache.note_full_compile(unit.id, spent)
    env.cache.put(unit.batch, unit.key, files,
                  {"unit": unit.id, "toolchain": env.toolchain} | entry_info(spent, full))
    return dataclasses.replace(_result(unit, env, files, "miss", start, seconds), compile=stats)


def cached_results(units: list[CompileUnit], env: CompileContext) -> dict[str, UnitResult]:
    """The units whose verified outputs are in the cache, written out as :func:`build_unit` writes a hit.

    A unit missing from the result is a miss, or its batch drifted (the event is in ``env.events`` and the
    batch is invalidated, so building it compiles): :func:`build_unit` builds it. A warm build resolves
    all of its units here, in one pass, instead of one orchestrated task each.
    """
    results = {}
    for unit in units:
        start = time.perf_counter()
        try:
            hit = env.cache.get(unit.batch, unit.key)
        except CacheDriftError as exc:
            env.events.append(f"{unit.id}: {exc}")
            continue
        if hit is not None:
            results[unit.id] = _result(unit, env, hit.files, "hit", start, on_hit(hit.info))
    return results


def _result(unit: CompileUnit, env: CompileContext, files: dict[str, bytes], cache: Literal["hit", "miss"],
            start: float, seconds: CompileSeconds) -> UnitResult:
    """Write the unit's ``files`` under ``env.out_dir`` and describe them."""
    files, device_code = _device_code(files)
    directory = (env.out_dir / unit.variant / unit_dir(unit)).resolve()
    written = []
    for name, data in files.items():
        # The run's view of a cached or just stored output: made again from the cache, so no fsync
        # (217 of them were half of a warm build's unit work).
        atomic_write_bytes(directory / name, data, durable=False)
        written.append(directory / name)
    entries = _entries(unit, files, written, env)
    size = sum(len(d) for d in files.values()) if unit.kind == "pep517" else sum(e["size"] for e in entries)
    return UnitResult(unit.id, cache, time.perf_counter() - start, tuple(written), tuple(entries),
                      size, device_code, seconds=seconds)


def unit_record(unit: CompileUnit, outcome: UnitResult | BaseException) -> Unit:
    """The run-manifest row for a unit, from its result or the error it ended with."""
    base = dict(id=unit.id, stage="build", variant=unit.variant, arch=unit.arch, kernel=unit.kernel)
    if isinstance(outcome, UnitResult):
        held = f"; {outcome.device_code}" if outcome.device_code else ""
        held += f"; {outcome.compile.describe()}" if outcome.compile is not None else ""
        return Unit(**base, state="completed", duration_s=outcome.duration_s, cache=outcome.cache,  # type: ignore[arg-type]
                    message=f"{outcome.size} bytes{held}")
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

