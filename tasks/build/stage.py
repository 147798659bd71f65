"""The build stage around its units: prepare the plan, assemble each variant, report.

``flows/build.py`` calls these through thin Prefect tasks; everything that
decides something about the build lives here, so it runs and is tested
without Prefect.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kiln.core.errors import AbiAuditError, ToolchainMissingError
from kiln.core.fsutil import atomic_write_text
from kiln.core.manifest import ArtifactKind, Unit
from kiln.core.objects import Store
from kiln.core.record import Checkout
from kiln.tasks.build import plancache, sparepool
from kiln.tasks.build.aot import toolchain_versions
from kiln.tasks.build.backend import ProjectBuilder, cuda_home
from kiln.tasks.build.buildenv import VariantEnvironments
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.cache_remote import RemoteTier
from kiln.tasks.build.compile_cache import compilations_noun, open_compile_cache
from kiln.tasks.build.compile_seconds import total
from kiln.tasks.build.compile_tier import shared_tier
from kiln.tasks.build.interpreters import cell_interpreters, check_cells_resolve
from kiln.tasks.build.nvcc import NvccBuilder, NvccSettings, find_cuobjdump, find_nvcc, missing_reason, settings_for
from kiln.tasks.build.plan import BuildPlan, CompileUnit, VariantPlan, kiln_state, plan_build
from kiln.tasks.build.units import CompileContext, UnitResult
from kiln.tasks.project.config import KilnConfig, Variant, load_config
from kiln.tasks.project.config_matrix import abi3_served
from kiln.tasks.project.config_project import pinned_version, requires
from kiln.tasks.project.registry_guest import RegistryData, load_registry_data
from kiln.tasks.project.registry_types import CudaSourceRecord
from kiln.tasks.run.versioning import check_build_version, variant_version
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel
from kiln.tasks.wheel.manylinux import why_not_manylinux
from kiln.tasks.wheel.rewheel import rewrite_wheel
from kiln.tasks.wheel.variants import VARIANT_WHEELS_DIR, write_variant_wheels

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildSetup:
    config: KilnConfig
    version: str
    plan: BuildPlan
    nvcc: NvccBuilder | None
    cache_root: Path
    stamp: WheelStamp = WheelStamp()
    project: ProjectBuilder | None = None  # [build] backend = "pep517"
    remote: RemoteTier | None = None  # [build.cache] remote: the unit cache's shared tier


def advised(setup: BuildSetup, advise: Callable[[Path, str, str, Mapping[str, str], str], list[str]]) -> BuildSetup:
    """``setup`` whose pep517 builder names, in a failed unit's message, the settings ``advise`` finds."""
    return setup if setup.project is None else replace(setup, project=replace(setup.project, advise=advise))


def unit_cache(setup: BuildSetup) -> BuildCache:
    """The build's unit cache: the worker's directory over the shared tier, when kiln.toml names one."""
    return BuildCache(setup.cache_root, setup.remote)


def remote_tier(config: KilnConfig, store: Store | None) -> RemoteTier | None:
    """The shared tier ``[build.cache]`` names in ``store`` (the run's artifact store, opened with the build
    step's credentials); None when it names none or no store is given."""
    settings = config.build.cache
    if settings.remote == "none" or store is None:
        return None
    return RemoteTier(store, settings.prefix, settings.read_only)


# The registry's records a head start is reading in its guest, by plan key (kiln.toml's path and bytes, the
# interpreter): the plan of the same command takes them instead of starting a guest of its own.
_ahead: dict[str, Future[RegistryData]] = {}
_ahead_lock = threading.Lock()


def head_start(config: KilnConfig) -> None:
    """What the next build of this process does first when it has no stored plan (so likely units to compile),
    done now by a command that waits meanwhile (Kiln's server starting): start the compile workers
    (kiln.tasks.build.sparepool), and start reading the project's kernel registry in its guest, as the plan
    does (torch, Triton: seconds). Nothing of the package is imported in this process."""
    if config.project.registry is None or all(v.backend == "cpu" for v in config.variants):
        return  # nothing to import, or a build that compiles nothing (see _plan)
    key = plancache.plan_key(config, None, None)
    if plancache.stored(config.path(config.build.cache_dir), key):
        return  # the plan is likely reused, and its units cached
    sparepool.prestart(str(config.config_file.resolve()), config.build.jobs, config.build.unit_timeout_s)
    future: Future[RegistryData] = Future()

    def read() -> None:
        try:
            future.set_result(load_registry_data(config))
        except BaseException as exc:  # the plan meets it: raised there, as its own read would raise it (and a
            future.set_exception(exc)  # future left unset would keep the plan waiting)

    with _ahead_lock:
        _ahead[key] = future
    # Not a daemon: an exit waits for the guest (bounded by its deadline) rather than leaving it and its scratch.
    threading.Thread(target=read, name="kiln-registry-ahead").start()


def _registry_data(config: KilnConfig) -> RegistryData:
    """The registry's records: the head start's, when it read them for this kiln.toml, else read now."""
    with _ahead_lock:
        ahead = _ahead.pop(plancache.plan_key(config, None, None), None)
    if ahead is not None:
        return ahead.result()
    return load_registry_data(config)


def prepare_build(config: KilnConfig | str, version: str, variants: list[str] | None, nvcc_path: str | None = None,
                  cache_dir: str | None = None, source: Checkout | None = None,
                  store: Store | None = None) -> BuildSetup:
    """Load the registry, find the toolchain, plan the matrix. Changes nothing on disk but the plan cache.

    ``config``: the flow's loaded config (a path is loaded here). The registry
    (and torch and Triton with it) is imported only when the plan
    stored by the last build with the same inputs (:mod:`kiln.tasks.build.plancache`)
    is missing or out of date. ``source`` is the commit being built: its time
    stamps every wheel member, its sha goes into each wheel's ``kiln_build.json``. ``store``: the artifact
    store the run's record is in, which holds the unit cache's shared tier when ``[build.cache]`` says so.
    """
    config = load_config(config) if isinstance(config, str) else config
    chosen = check_build_version(version)  # a malformed --version fails here, before anything is built
    wanted = [config.variant(name) for name in variants] if variants else list(config.variants)
    cell_interpreters(config, wanted)  # a matrix cell with no interpreter here is refused before anything builds
    cache_root = Path(cache_dir) if cache_dir else config.path(config.build.cache_dir)
    check_cells_resolve(config, wanted, cache_root / "envs")  # and one whose torch cannot be had
    key = plancache.plan_key(config, variants, nvcc_path)
    stored = plancache.load(cache_root, key, config)
    tools = _tools(config, wanted, nvcc_path, dict(stored.csrc), stored.settings) if stored is not None else None
    if stored is None or tools is None or (tools.toolchain, tools.missing) != (stored.toolchain, stored.missing):
        stored, tools, data = _plan(config, wanted, variants, nvcc_path)
        plancache.store(cache_root, key, config, stored, data.module_files, data.dists)
        if data.read:  # the registry was read: what the bench stage needs of it, so it never imports it
            plancache.store_bench_kernels(cache_root, config, data.bench_kernels, data.module_files, data.dists)
    else:
        _log.info("reusing the stored build plan %s: its inputs are unchanged", key[:16])
    source = source or Checkout()
    stamp = WheelStamp.for_commit(source.commit, source.commit_time, tools.toolchain)
    compile_cache = (open_compile_cache(cache_root, shared_tier(config.build.cache, store))
                     if tools.nvcc is not None or tools.project is not None else None)
    nvcc = replace(tools.nvcc, cache=compile_cache) if tools.nvcc is not None else None
    project = replace(tools.project, compile_cache=compile_cache) if tools.project is not None else None
    return BuildSetup(config, chosen, stored.plan, nvcc, cache_root, stamp,
                      project, remote_tier(config, store))


@dataclass(frozen=True)
class _Tools:
    toolchain: dict[str, str]
    nvcc: NvccBuilder | None
    missing: str
    project: ProjectBuilder | None


def _tools(config: KilnConfig, wanted: list[Variant], nvcc_path: str | None,
           csrc: dict[str, CudaSourceRecord], settings: NvccSettings | None = None) -> _Tools:
    """The toolchain found now, for a registry with CUDA sources ``csrc`` (nvcc is looked for only then).

    ``settings``: the stored plan's nvcc settings; None works them out (with torch = true, by importing torch).
    """
    toolchain = toolchain_versions()
    builder, missing = None, ""
    if csrc:
        try:
            nvcc = find_nvcc(nvcc_path)
            toolchain["nvcc"] = nvcc.version
            builder = NvccBuilder(nvcc, config.path(config.project.source), csrc,
                                  settings_for(config) if settings is None else settings)
        except ToolchainMissingError as exc:
            missing = missing_reason(exc)
            _log.warning(missing)
    project = project_builder(config, wanted, nvcc_path, toolchain) if config.build.backend == "pep517" else None
    return _Tools(toolchain, builder, missing, project)


def _plan(config: KilnConfig, wanted: list[Variant], variants: list[str] | None,
          nvcc_path: str | None) -> tuple[plancache.StoredPlan, _Tools, RegistryData]:
    """Plan from the registry itself, read now by its guest (never imported in this process)."""
    # A CPU variant compiles nothing: its wheel is the package's sources, so no registry is imported.
    data = _registry_data(config) if any(v.backend != "cpu" for v in wanted) else RegistryData((), read=False)
    specs = data.kernels
    csrc = {s.name: s.csrc for s in specs if s.csrc is not None}
    tools = _tools(config, wanted, nvcc_path, csrc)
    plan = plan_build(config, specs, tools.toolchain, variants, tools.missing)
    settings = tools.nvcc.settings if tools.nvcc is not None else NvccSettings()
    return plancache.StoredPlan(plan, csrc, settings, tools.toolchain, tools.missing), tools, data


def project_builder(config: KilnConfig, wanted: list[Variant], nvcc_path: str | None,
                    toolchain: dict[str, str]) -> ProjectBuilder:
    """The pep517 backend for ``wanted``; a CUDA variant's nvcc (its version joins ``toolchain``) is the project's
    to need: without one the backend build runs anyway, and fails with its own message if it needs it."""
    home, cuobjdump = None, None
    if any(v.backend == "cuda" for v in wanted):
        try:
            nvcc = find_nvcc(nvcc_path)
            toolchain["nvcc"], home, cuobjdump = nvcc.version, cuda_home(nvcc.path), nvcc.cuobjdump
        except ToolchainMissingError as exc:
            _log.warning("pep517 build without nvcc: %s", exc)
    if cuobjdump is None:
        try:
            cuobjdump = find_cuobjdump()
        except ToolchainMissingError as exc:  # a CUDA variant's unit then fails: its device code cannot be checked
            _log.warning("%s", exc)
    build = config.build
    # The backend runs in a copy of the project: its include and library dirs are passed resolved.
    toolchain_dirs = build.toolchain.model_copy(update={
        "include_dirs": tuple(str(config.path(d)) for d in build.toolchain.include_dirs),
        "library_dirs": tuple(str(config.path(d)) for d in build.toolchain.library_dirs)})
    return ProjectBuilder(config.path(build.project_dir), config.project.distribution, toolchain_dirs,
                          build.backend_timeout_s, build.jobs, home, cuobjdump, kiln_state(config),
                          {v.name: dict(v.build_env) for v in config.variants if v.build_env},
                          {v.name: v.torch_target for v in config.variants if v.abi == "stable"},
                          pass_env=build.pass_env)


def variant_environments(setup: BuildSetup) -> VariantEnvironments:
    """The build's variant environments, under the build cache (``envs/``), made when a unit first needs one."""
    config = setup.config
    return VariantEnvironments(setup.cache_root / "envs", {v.name: (v.backend, v.build_requires)
                                                          for v in config.variants}, config.build.backend_timeout_s,
                               cell_interpreters(config, config.variants, strict=False))


def variant_stamp(setup: BuildSetup, variant: Variant) -> WheelStamp:
    """The stamp of ``variant``'s wheel: its toolchain names the torch of the variant's build environment,
    which the wheel then pins where its binary needs it (a torch extension has no stable C++ ABI)."""
    if not requires(variant.build_requires, "torch"):
        return setup.stamp
    torch = pinned_version(variant.build_requires, "torch")
    if torch is None:  # a range: the environment says which torch it resolved to
        found = variant_environments(setup).torch(variant.name)
        torch = found.version if found is not None else None
    if torch is None:
        return setup.stamp
    return replace(setup.stamp, toolchain=tuple(sorted({**dict(setup.stamp.toolchain), "torch": torch}.items())))


def worker_config(setup: BuildSetup) -> str:
    """The kiln.toml a compile worker loads in its own process (the one place a build hands on a path)."""
    return str(setup.config.config_file.resolve())


@contextmanager
def compile_context(setup: BuildSetup, out: str | Path, jobs: int | None = None) -> Iterator[CompileContext]:
    """Workers and cache for one build (the ones started ahead of it, if any: kiln.tasks.build.sparepool);
    the workers stop and their Triton cache is removed when the block ends."""
    size = jobs or setup.config.build.jobs
    config_file = worker_config(setup)
    compile_pool = sparepool.take(config_file, size) or sparepool.new_pool(size, Path(config_file).parent)
    try:
        yield CompileContext(worker_config(setup), Path(out).resolve() / "build", unit_cache(setup),
                             compile_pool.pool, setup.config.build.unit_timeout_s, setup.plan.toolchain, setup.nvcc,
                             setup.project, environments=variant_environments(setup), config=setup.config)
    finally:
        compile_pool.close()


@dataclass(frozen=True)
class VariantOutput:
    unit: Unit
    files: tuple[tuple[Path, ArtifactKind], ...]  # (path, artifact kind) to register in the run manifest


def wheel_unit_id(variant: str) -> str:
    """The unit that stands for ``variant``'s wheel (built, or skipped because a unit failed)."""
    return f"build/{variant}/wheel"


def assemble_variant(setup: BuildSetup, variant: VariantPlan, outcomes: dict[str, UnitResult | BaseException],
                     out: str | Path) -> VariantOutput:
    """Write the variant's build manifest and wheel, or skip both if any unit failed."""
    uid = wheel_unit_id(variant.name)
    failed = [u.id for u in variant.units if not isinstance(outcomes.get(u.id), UnitResult)]
    if failed:
        reason = f"not built: {len(failed)} units of {variant.name} failed"
        return VariantOutput(Unit(uid, "build", "skipped", variant=variant.name, message=reason), ())
    results = [outcomes[u.id] for u in variant.units]
    variant_dir = Path(out).resolve() / "build" / variant.name
    entries = [e for r in results for e in r.entries]  # type: ignore[union-attr]
    files = [p for r in results for p in r.files]  # type: ignore[union-attr]
    built = [p for p in files if p.suffix == ".whl"]  # the project's own backend's wheel (pep517)
    if built and (served := abi3_served(setup.config.variants, variant.name, built[0].name)):
        return VariantOutput(Unit(uid, "build", "skipped", variant=variant.name, message=served), ())
    binaries = [WheelInput(p, p.relative_to(variant_dir).as_posix()) for p in files if p.suffix != ".whl"]
    manifest = variant_dir / "manifest.json"
    atomic_write_text(manifest, json.dumps(sorted(entries, key=lambda e: e["path"]), indent=2, sort_keys=True) + "\n")
    # A pure-Triton package's one portable wheel keeps the plain version: there is nothing variant about it.
    label = setup.config.variant(variant.name).label  # a matrix cell's: its variant's, with its torch if several
    version = setup.version if setup.config.build.kind == "triton-jit" else variant_version(setup.version, label)
    config, wheels = setup.config, Path(out).resolve() / "wheels"
    cache = BuildCache(setup.cache_root)  # a warm build copies wheels of unchanged members (the local tier only)
    stamp = variant_stamp(setup, config.variant(variant.name))
    try:
        if built:
            wheel = rewrite_wheel(config, config.variant(variant.name), version, built[0], binaries, entries, wheels,
                                  stamp, cache=cache)
        else:
            wheel = build_wheel(config, version, binaries, entries, wheels, variant=config.variant(variant.name),
                                stamp=stamp, cache=cache)
    except AbiAuditError as exc:  # the wheel is not what it claims: this variant's unit fails, the others go on
        _log.error("%s", exc)
        return VariantOutput(Unit(uid, "build", "failed", variant=variant.name, message=str(exc)), ())
    # The same contents as PEP 825 variant wheels of the public version, for one page of every variant.
    variant_wheels = write_variant_wheels(config, config.variant(variant.name), wheel,
                                          Path(out).resolve() / VARIANT_WHEELS_DIR, stamp, cache=cache)
    kinds = tuple((f, kind) for r in results for f in r.files if (kind := _kind(f)))  # type: ignore[union-attr]
    held = "".join(f"; {r.device_code}" for r in results if r.device_code)  # type: ignore[union-attr]
    if why := why_not_manylinux(wheel, config.variant(variant.name).backend, cache):
        held += f"; not manylinux: {why}"
    unit = Unit(uid, "build", "completed", variant=variant.name,
                message=f"{wheel.name} ({len(entries)} compiled artifacts{held})")
    extra: tuple[tuple[Path, ArtifactKind], ...] = tuple((p, "variant-wheel") for p in variant_wheels)
    return VariantOutput(unit, ((wheel, "wheel"), *extra, (manifest, "build-manifest")) + kinds)


_KINDS: dict[str, ArtifactKind] = {".cubin": "cubin", ".hsaco": "hsaco", ".so": "shared-library"}


def _kind(path: Path) -> ArtifactKind | None:
    return _KINDS.get(path.suffix)


def table_rows(units: list[CompileUnit], outcomes: dict[str, UnitResult | BaseException],
               records: dict[str, Unit]) -> list[dict[str, Any]]:
    """The build table: unit, arch, state, time, cache hit/miss, compile seconds spent and saved, size."""
    rows = []
    for unit in units:
        outcome, record = outcomes.get(unit.id), records[unit.id]
        size = outcome.size if isinstance(outcome, UnitResult) else 0
        cache = unit_cache_state(outcome) if isinstance(outcome, UnitResult) else record.cache
        seconds = outcome.seconds if isinstance(outcome, UnitResult) else None
        rows.append({"unit": unit.id, "arch": unit.arch, "state": record.state, "time_s": round(record.duration_s, 2),
                     "cache": cache, "compile_s": round(seconds.spent, 2) if seconds else "",
                     "saved_s": "" if seconds is None else "n/a" if seconds.saved is None else round(seconds.saved, 2),
                     "size": size, "device_code": outcome.device_code if isinstance(outcome, UnitResult) else ""})
    return rows


def unit_cache_state(outcome: UnitResult) -> str:
    """``hit`` (the unit cache served it), ``partial (k of n)`` (the compile cache served all but k of its n
    translation units), or ``miss`` (every translation unit, or a unit without them, compiled)."""
    stats = outcome.compile
    if outcome.cache == "hit" or stats is None or not stats.reused:
        return outcome.cache
    return f"partial ({len(stats.compiled)} of {len(stats.compiled) + len(stats.reused)})"


def compile_line(outcomes: dict[str, UnitResult | BaseException]) -> str:
    """The build's translation units compiled and reused by the compile cache, over every native unit that ran, and
    the compile seconds every unit spent and the caches saved (:mod:`kiln.tasks.build.compile_seconds`)."""
    results = [o for o in outcomes.values() if isinstance(o, UnitResult)]
    stats = [o.compile for o in results if o.compile is not None]
    compiled, reused = sum(len(s.compiled) for s in stats), sum(len(s.reused) for s in stats)
    seconds = total(o.seconds for o in results).describe()
    if not stats:
        return f"Compile: no native unit compiled (every one served by the unit cache, or none planned); {seconds}."
    return (f"Compile: {compiled} of {compiled + reused} {compilations_noun(stats)} compiled, {reused} reused from the "
            f"compile cache, in {len(stats)} native units; {seconds}.")


def cache_report(events: list[str], compiled: str = "") -> str:
    """Markdown for the cache-events artifact: the compile line, then every drift found and healed."""
    head = f"# Build cache\n\n{compiled}\n\n" if compiled else "# Build cache\n\n"
    if not events:
        return f"{head}No drift: every cache entry used matched its recorded sha256.\n"
    lines = "\n".join(f"- {e}" for e in events)
    return (f"{head}{len(events)} drift event(s); the affected batches were invalidated and rebuilt:"
            f"\n\n{lines}\n")
