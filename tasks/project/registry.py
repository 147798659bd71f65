"""Load the project's kernel registry named by ``kiln.toml``'s ``project.registry``.

The pipeline never imports the kernel package by name: it imports the
``"module:attr"`` entry point with the project's root on ``sys.path``, calls
it, and validates every field of what comes back — ``kiln.runtime.spec``
objects, or duck-typed objects with every field of those types — before
anything compiles. What it read is copied into Kiln's frozen records
(:mod:`kiln.tasks.project.registry_types`); the planner, the compile workers and the
benchmark harness read only those. Every problem becomes a
:class:`ConfigError` naming the entry point, the kernel, the specialization
(when there is one) and the field.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, get_args

from kiln.core.errors import ConfigError, InvalidInputError
from kiln.runtime import spec
from kiln.tasks.project.archs import validate_arch
from kiln.tasks.project.registry_types import (
    BenchCaseRecord,
    CudaSourceRecord,
    FrozenMap,
    GpuBackend,
    KernelRecord,
    SpecializationRecord,
    TritonRecord,
)

if TYPE_CHECKING:  # only its type: a registry's guest reads a RegistrySource, without loading kiln.toml's models
    from kiln.tasks.project.config import KilnConfig

_log = logging.getLogger(__name__)
# What a kernel package's registry module defined, before it is checked: any Python object (its own code made it),
# so Any; each function taking one checks it and says what it expected.
Unchecked = Any


def _ensure_on_path(root: str) -> None:
    # First on the path: the project's own package wins over a same-named one elsewhere.
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)


def _forget_other_copies(module_name: str, root: str) -> None:
    """Drop a same-named package imported from another project root, so a
    process that builds two projects (tests, a monorepo) gets each one's own."""
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    location = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", [])), None)
    if loaded is None or location is None or Path(location).resolve().is_relative_to(Path(root).resolve()):
        return
    _log.info("re-importing %s from %s (was %s)", top, root, location)
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _import_entry(entry: str, root: str | None) -> Any:
    module_name, _, attr = entry.partition(":")
    if root is not None:
        _ensure_on_path(root)
        _forget_other_copies(module_name, root)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"project.registry = {entry!r}: cannot import module {module_name!r} "
            f"from {root or 'the installed package'}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"project.registry = {entry!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(target):
        raise ConfigError(f"project.registry = {entry!r} is not callable (got {type(target).__name__})")
    return target


# --- validation: the project's objects -> Kiln's records ------------------------

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_LIBRARY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*\.so$")
_GPU_BACKENDS: tuple[GpuBackend, ...] = get_args(GpuBackend)


@dataclass(frozen=True)
class _Where:
    """Where a problem is: ``project.registry = '…': kernel 'add', specialization 'fp32_b64'``."""

    prefix: str
    parts: tuple[str, ...] = ()

    def inside(self, part: str) -> _Where:
        return _Where(self.prefix, self.parts + (part,))

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.prefix}{', '.join(self.parts)}: field {field!r} {problem}")


@dataclass(frozen=True)
class _Project:
    package: str
    package_dir: Path


def module_file(package_dir: Path, package: str, module: str) -> Path | None:
    """The file of ``module`` (``package.sub`` -> ``<package_dir>/sub.py`` or ``sub/__init__.py``),
    or None when it is not a module of ``package`` or has no file there."""
    if module != package and not module.startswith(package + "."):
        return None
    parts = module.split(".")[1:]
    base = package_dir.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _got(value: Unchecked) -> str:
    return repr(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else type(value).__name__


def _fields(obj: Unchecked, shape: type, where: _Where) -> dict[str, Any]:
    """Every field of ``kiln.runtime.spec.<shape>`` read from ``obj`` (a spec instance or a duck-typed one)."""
    out = {}
    for field in dataclasses.fields(shape):
        try:
            out[field.name] = getattr(obj, field.name)
        except AttributeError:
            raise where.error(field.name, f"is missing: the object has no attribute {field.name!r} (a duck-typed"
                                          f" object needs every field of kiln.runtime.spec.{shape.__name__})") from None
    return out


def _name(obj: Unchecked, label: str, shape: type, where: _Where) -> tuple[str, _Where]:
    """The object's ``name``, checked (it names units and files), and where it is."""
    try:
        name = obj.name
    except AttributeError:
        raise where.inside(label).error("name", f"is missing: the object has no attribute 'name' (return"
                                                f" kiln.runtime.spec.{shape.__name__} objects)") from None
    if not isinstance(name, str) or not _NAME.match(name):
        raise where.inside(label).error("name", f"must be a name of letters, digits, '_', '.' and '-'"
                                                f" (it names build units and files), got {_got(name)}")
    return name, where.inside(f"{label.split(' #')[0]} {name!r}")


def _sequence(value: Unchecked, where: _Where, field: str, what: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise where.error(field, f"must be a list or tuple of {what}, got {_got(value)}")
    return tuple(value)


def _strings(value: Unchecked, where: _Where, field: str, what: str) -> tuple[str, ...]:
    items = _sequence(value, where, field, what)
    bad = [item for item in items if not isinstance(item, str) or not item]
    if bad:
        raise where.error(field, f"must be a list or tuple of {what}, got {bad[0]!r}")
    return items


def _mapping(value: Unchecked, where: _Where, field: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise where.error(field, f"must map {what}, got {_got(value)}")
    return value


def _arch(arch: Unchecked, backend: str, where: _Where, field: str) -> str:
    if not isinstance(arch, str):
        raise where.error(field, f"must hold {backend} arch names, got {_got(arch)}")
    try:
        return validate_arch(arch, backend)
    except InvalidInputError as exc:
        raise where.error(field, f"has a bad arch: {exc}") from exc


def _supported(value: Unchecked, where: _Where) -> FrozenMap[str, tuple[str, ...]]:
    supported = _mapping(value, where, "supported", "a backend ('cuda', 'hip') to its archs")
    out: dict[str, tuple[str, ...]] = {}
    for backend, archs in supported.items():
        if backend not in _GPU_BACKENDS:
            raise where.error("supported", f"has unknown backend {backend!r}; expected one of {_GPU_BACKENDS}")
        field = f"supported[{backend!r}]"
        out[backend] = tuple(_arch(a, backend, where, field) for a in _sequence(archs, where, field, "arch names"))
    return FrozenMap(out)


def _module(value: Unchecked, where: _Where, project: _Project) -> str:
    if not isinstance(value, str) or module_file(project.package_dir, project.package, value) is None:
        raise where.error("module", f"must name a module of package {project.package!r} with a file under"
                                    f" {project.package_dir} (its sources are hashed for the cache), got {_got(value)}")
    return value


def _signature(value: Unchecked, where: _Where, fn: Unchecked) -> FrozenMap[str, str]:
    problem = "must map parameter names to Triton type strings"
    if not isinstance(value, Mapping):
        raise where.error("signature", f"{problem}, got {_got(value)}")
    for param, kind in value.items():
        if not isinstance(param, str) or not isinstance(kind, str) or not kind:
            raise where.error("signature", f"{problem}, got {param!r}: {kind!r}")
    arg_names = getattr(fn, "arg_names", None)
    if isinstance(arg_names, (list, tuple)):
        call = f"{getattr(fn, '__name__', 'fn')}({', '.join(map(str, arg_names))})"
        missing = [p for p in arg_names if p not in value]
        extra = [p for p in value if p not in arg_names]
        if missing:
            raise where.error("signature", f"gives no type for parameters {missing} of {call}")
        if extra:
            raise where.error("signature", f"names {extra}, which are not parameters of {call}")
    return FrozenMap(value)


def _constexprs(value: Unchecked, where: _Where, signature: Mapping[str, str]) -> FrozenMap[str, Any]:
    constexprs = _mapping(value, where, "constexprs", "constexpr parameter names to values")
    declared = [p for p, kind in signature.items() if kind == "constexpr"]
    unknown = [p for p in constexprs if p not in declared]
    if unknown:
        raise where.error("constexprs", f"gives values for {unknown}, which the signature does not type 'constexpr'")
    missing = [p for p in declared if p not in constexprs]
    if missing:
        raise where.error("constexprs", f"has no value for the constexpr parameters {missing}")
    return FrozenMap(constexprs)


def _backends(value: Unchecked, where: _Where) -> tuple[GpuBackend, ...]:
    backends = _strings(value, where, "backends", f"backends from {_GPU_BACKENDS}")
    unknown = [b for b in backends if b not in _GPU_BACKENDS]
    if unknown or not backends or len(set(backends)) != len(backends):
        raise where.error("backends", f"must list distinct backends from {_GPU_BACKENDS}, got {list(backends)}")
    return backends  # type: ignore[return-value]


def _min_arch(value: Unchecked, where: _Where) -> FrozenMap[str, str]:
    min_arch = _mapping(value, where, "min_arch", "a backend to its lowest arch")
    out: dict[str, str] = {}
    for backend, arch in min_arch.items():
        if backend not in _GPU_BACKENDS:
            raise where.error("min_arch", f"has unknown backend {backend!r}; expected one of {_GPU_BACKENDS}")
        out[backend] = _arch(arch, backend, where, f"min_arch[{backend!r}]")
    return FrozenMap(out)


def _aligned(value: Unchecked, where: _Where, signature: Mapping[str, str]) -> tuple[str, ...]:
    aligned = _strings(value, where, "aligned", "parameter names")
    wrong = [p for p in aligned if signature.get(p, "constexpr") == "constexpr"]
    if wrong:
        raise where.error("aligned", f"names {wrong}, which are not runtime parameters in the signature")
    return aligned


def _specialization(obj: Unchecked, index: int, kernel: _Where, fn: Unchecked) -> SpecializationRecord:
    name, where = _name(obj, f"specialization #{index}", spec.Specialization, kernel)
    f = _fields(obj, spec.Specialization, where)
    signature = _signature(f["signature"], where, fn)
    options = _mapping(f["options"], where, "options", "triton.compile option names to values")
    return SpecializationRecord(
        name=name, signature=signature, constexprs=_constexprs(f["constexprs"], where, signature),
        backends=_backends(f["backends"], where), min_arch=_min_arch(f["min_arch"], where),
        options=FrozenMap(options), aligned=_aligned(f["aligned"], where, signature),
    )


def _triton_entry(obj: Unchecked, index: int, kernel: _Where) -> TritonRecord:
    name, where = _name(obj, f"triton entry #{index}", spec.TritonEntry, kernel)
    f = _fields(obj, spec.TritonEntry, where)
    if f["fn"] is None:
        raise where.error("fn", "must be the entry's @triton.jit function, got None")
    specializations = _sequence(f["specializations"], where, "specializations", "Specialization objects")
    if not specializations:
        raise where.error("specializations", "is empty: an entry compiles nothing without one")
    records = tuple(_specialization(s, i, kernel, f["fn"]) for i, s in enumerate(specializations))
    fn_module = getattr(getattr(f["fn"], "fn", f["fn"]), "__module__", "")  # a JITFunction wraps the function
    return TritonRecord(name=name, fn=f["fn"], specializations=records,
                        fn_module=fn_module if isinstance(fn_module, str) else "")


def _csrc(obj: Unchecked, kernel: _Where, project: _Project) -> CudaSourceRecord:
    name, where = _name(obj, "csrc", spec.CudaSource, kernel)
    f = _fields(obj, spec.CudaSource, where)
    sources = _strings(f["sources"], where, "sources", "paths relative to the package directory")
    if not sources:
        raise where.error("sources", "is empty: name the .cu/.cpp files to build")
    for index, source in enumerate(sources):
        path = PurePosixPath(source)
        if path.is_absolute() or ".." in path.parts or "\\" in source:
            raise where.error(f"sources[{index}]", f"names {source!r}; sources are relative to the package"
                                                   " directory, without '..'")
        if not (project.package_dir / path).is_file():
            raise where.error(f"sources[{index}]", f"names {source!r}, which is not a file under {project.package_dir}")
    supported = tuple(
        _arch(a, "cuda", where, "supported") for a in _strings(f["supported"], where, "supported", "CUDA archs")
    )
    library = f["library"]
    if not isinstance(library, str) or not _LIBRARY.match(library):
        raise where.error("library", f"must be a shared-library file name ending in '.so', got {_got(library)}")
    return CudaSourceRecord(name=name, sources=sources, supported=supported, library=library)


def _unique(names: list[str], where: _Where, field: str, what: str) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise where.error(field, f"has duplicate {what} {dupes} (each names its own build units and files)")


def _kernel(obj: Unchecked, index: int, top: _Where, project: _Project) -> KernelRecord:
    name, where = _name(obj, f"kernel #{index}", spec.KernelSpec, top)
    f = _fields(obj, spec.KernelSpec, where)
    triton = tuple(_triton_entry(e, i, where) for i, e in
                   enumerate(_sequence(f["triton"], where, "triton", "TritonEntry objects")))
    _unique([e.name for e in triton], where, "triton", "entry names")
    _unique([s.name for e in triton for s in e.specializations], where, "triton", "specialization names")
    if f["bench_cases"] is not None and not callable(f["bench_cases"]):
        raise where.error("bench_cases", f"must be a callable size -> cases, or None, got {_got(f['bench_cases'])}")
    if not isinstance(f["description"], str):
        raise where.error("description", f"must be a string, got {_got(f['description'])}")
    return KernelRecord(
        name=name, module=_module(f["module"], where, project), supported=_supported(f["supported"], where),
        triton=triton, csrc=None if f["csrc"] is None else _csrc(f["csrc"], where, project),
        bench_cases=f["bench_cases"], description=f["description"],
    )


@dataclass(frozen=True)
class RegistrySource:
    """What of ``kiln.toml`` reading the registry needs (its guest gets this, not the whole file)."""

    entry: str | None  # project.registry
    package: str
    package_dir: str  # absolute: project.source
    import_root: str  # absolute: the folder the package is imported from


def registry_source(config: KilnConfig | RegistrySource) -> RegistrySource:
    if isinstance(config, RegistrySource):
        return config
    return RegistrySource(config.project.registry, config.project.package, str(config.path(config.project.source)),
                          str(config.import_root))


def read_registry(config: KilnConfig | RegistrySource, specs: Unchecked,
                  entry: str | None = None) -> list[KernelRecord]:
    """Validate what a registry returned and copy it into :class:`KernelRecord` objects.

    ``specs``: ``kiln.runtime.spec.KernelSpec`` objects or duck-typed ones with
    every field. Raises :class:`ConfigError` naming the kernel, the
    specialization (when there is one) and the field.
    """
    source = registry_source(config)
    entry = entry or source.entry or "(none)"
    top = _Where(f"project.registry = {entry!r}: ")
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"project.registry = {entry!r} must return a list of KernelSpec, got {type(specs).__name__}")
    project = _Project(source.package, Path(source.package_dir))
    records = [_kernel(s, i, top, project) for i, s in enumerate(specs)]
    names = [r.name for r in records]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"project.registry = {entry!r}: duplicate kernel name {name!r}")
    libraries = [r.csrc.library for r in records if r.csrc is not None]
    for library in libraries:
        if libraries.count(library) > 1:
            owners = [r.name for r in records if r.csrc is not None and r.csrc.library == library]
            raise ConfigError(f"project.registry = {entry!r}: kernels {owners} all build {library!r}; "
                              "each csrc needs its own library file name")
    return records


def load_registry(config: KilnConfig | RegistrySource, installed: bool = False) -> list[KernelRecord]:
    """Import and call ``config.project.registry``; return its validated kernels as records.

    This runs the package's code in the calling process: Kiln calls it only in a guest (a compile worker, the
    registry's guest of :mod:`kiln.tasks.project.registry_guest`, the benchmark harness).

    Raises :class:`ConfigError` when the entry point cannot be imported, is
    not callable, raises, or returns anything :func:`read_registry` refuses.
    """
    source = registry_source(config)
    entry = source.entry
    if entry is None:  # a project built by its own backend, with nothing for Kiln to compile
        return []
    # installed: the package this interpreter has installed (a test environment's
    # wheel); otherwise the project's source tree, first on the path.
    factory = _import_entry(entry, None if installed else source.import_root)
    _log.info("loading kernel registry %s", entry)
    try:
        specs = factory()
    except Exception as exc:  # the project's code: translate whatever it raises
        raise ConfigError(f"project.registry = {entry!r} raised {type(exc).__name__}: {exc}") from exc
    return read_registry(source, specs, entry)


def bench_case_record(case: Unchecked, kernel: str, size: str, index: int) -> BenchCaseRecord:
    """One case ``bench_cases(size)`` returned, validated and copied (the callables as they are)."""
    top = _Where("", (f"kernel {kernel!r}: bench_cases({size!r})",))
    name, where = _name(case, f"case #{index}", spec.BenchCase, top)
    f = _fields(case, spec.BenchCase, where)
    if f["kernel"] != kernel:
        raise where.error("kernel", f"is {_got(f['kernel'])}, but the case is listed by kernel {kernel!r}")
    shape = _mapping(f["shape"], where, "shape", "dimension names to sizes")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in shape.values()):
        raise where.error("shape", f"must map dimension names to int sizes, got {dict(shape)!r}")
    for field in ("make_inputs", "fn", "reference"):
        if not callable(f[field]):
            raise where.error(field, f"must be callable, got {_got(f[field])}")
    for field in ("bytes", "flops"):
        if not isinstance(f[field], int) or isinstance(f[field], bool) or f[field] < 0:
            raise where.error(field, f"must be a non-negative int, got {_got(f[field])}")
    if f["dtype"] is None:
        raise where.error("dtype", "must name the case's dtype, got None")
    return BenchCaseRecord(kernel=kernel, name=name, shape=FrozenMap(shape), dtype=str(f["dtype"]),
                           make_inputs=f["make_inputs"], fn=f["fn"], reference=f["reference"],
                           bytes=f["bytes"], flops=f["flops"])
