"""Load the project's kernel registry named by ``kiln.toml``'s ``project.registry``.

The pipeline never imports the kernel package by name: it imports the
``"module:attr"`` entry point with the project's root on ``sys.path``, calls
it, and checks that what comes back has the shape of
``kernels.registry.KernelSpec`` (duck-typed, so another package may ship its
own dataclasses). Every problem becomes a :class:`ConfigError` naming the
entry point and the offending kernel.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from release.errors import ConfigError, InvalidInputError
from tasks.archs import validate_arch
from tasks.config import KilnConfig

_log = logging.getLogger("kiln.registry")

_BACKENDS = ("cuda", "hip")


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


def _import_entry(entry: str, root: str) -> Any:
    module_name, _, attr = entry.partition(":")
    _ensure_on_path(root)
    _forget_other_copies(module_name, root)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"project.registry = {entry!r}: cannot import module {module_name!r} from {root}: {exc}"
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


def _check_spec(spec: Any, entry: str) -> None:
    name = getattr(spec, "name", None)
    where = f"project.registry = {entry!r}: kernel {name!r}"
    for attr in ("name", "module", "supported", "triton"):
        if not hasattr(spec, attr):
            raise ConfigError(f"{where} has no attribute {attr!r}; return KernelSpec objects")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name must be a non-empty string")
    if not isinstance(spec.supported, Mapping):
        raise ConfigError(f"{where}: supported must map a backend to archs, got {type(spec.supported).__name__}")
    for backend, archs in spec.supported.items():
        if backend not in _BACKENDS:
            raise ConfigError(f"{where}: supported has unknown backend {backend!r}; expected one of {_BACKENDS}")
        for arch in archs:
            try:
                validate_arch(arch, backend)
            except InvalidInputError as exc:
                raise ConfigError(f"{where}: supported[{backend!r}]: {exc}") from exc
    for entry_point in spec.triton:
        for attr in ("name", "fn", "specializations"):
            if not hasattr(entry_point, attr):
                raise ConfigError(f"{where}: triton entry has no attribute {attr!r}")
        for special in entry_point.specializations:
            if not isinstance(getattr(special, "signature", None), Mapping):
                raise ConfigError(f"{where}: specialization {getattr(special, 'name', '?')!r} has no signature mapping")
    csrc = getattr(spec, "csrc", None)
    if csrc is not None:
        for arch in csrc.supported:
            try:
                validate_arch(arch, "cuda")
            except InvalidInputError as exc:
                raise ConfigError(f"{where}: csrc.supported: {exc}") from exc


def load_registry(config: KilnConfig) -> list[Any]:
    """Import and call ``config.project.registry``; return its validated kernel specs.

    Raises :class:`ConfigError` when the entry point cannot be imported, is
    not callable, raises, or returns something that is not a list of
    uniquely named kernel specs with valid arch names.
    """
    entry = config.project.registry
    factory = _import_entry(entry, str(config.root))
    _log.info("loading kernel registry %s", entry)
    try:
        specs = factory()
    except Exception as exc:  # the project's code: translate whatever it raises
        raise ConfigError(f"project.registry = {entry!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"project.registry = {entry!r} must return a list of KernelSpec, got {type(specs).__name__}")
    names: set[str] = set()
    for spec in specs:
        _check_spec(spec, entry)
        if spec.name in names:
            raise ConfigError(f"project.registry = {entry!r}: duplicate kernel name {spec.name!r}")
        names.add(spec.name)
    return list(specs)
