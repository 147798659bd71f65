"""The project's kernel registry, read by a guest: the planner gets its records as data.

Importing the registry runs the package's code (its modules, torch, Triton,
whatever they import), so the planner never imports it in Kiln's process,
which holds the step's credentials and network. :func:`load_registry_data`
starts ``python -P -m kiln.tasks.project.registry_guest`` as a guest
(:mod:`kiln.core.sandbox`, like a compile worker: an allow-listed environment,
no network, reading the project, the interpreters and Kiln's code, writing only
its own scratch). The child imports, calls and validates the registry
(:func:`kiln.tasks.project.registry.load_registry`) and writes JSON: every
record, with each Triton entry's ``fn`` reduced to its module's name and each
kernel's ``bench_cases`` to whether it has one, and what the import loaded (the
plan cache's inputs). Constexprs and options keep their type where JSON has it
and are otherwise carried by their ``repr`` (:class:`OpaqueValue`), which is
what plan keys hash, so a plan from the guest's data equals one from the
records themselves. A :class:`ConfigError` in the child arrives with its
message unchanged; a child that dies or runs past its deadline is a
:class:`ConfigError` naming the entry point and the end of its output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.errors import ConfigError
from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.process import run_in_group
from kiln.tasks.project.registry import RegistrySource, load_registry, registry_source
from kiln.tasks.project.registry_types import (
    CudaSourceRecord,
    FrozenMap,
    KernelRecord,
    OpaqueValue,
    SpecializationRecord,
    TritonRecord,
)

if TYPE_CHECKING:  # only its type: the guest reads a RegistrySource and starts without kiln.toml's models
    from kiln.tasks.project.config import KilnConfig

GUEST_MODULE = "kiln.tasks.project.registry_guest"
# Start an interpreter, import the package's registry (torch and Triton with it) and validate it.
REGISTRY_TIMEOUT_S = 300.0
_GRACE_S = 2.0


@dataclass(frozen=True)
class RegistryData:
    """What the planner and the plan cache need of the registry, read by a guest."""

    kernels: tuple[KernelRecord, ...]  # Triton entries' fn is None (see TritonRecord.fn_module); no bench_cases
    bench_kernels: tuple[str, ...] = ()  # the kernels that declare bench_cases
    module_files: tuple[str, ...] = ()  # files of the modules the guest loaded outside the interpreter's own trees
    dists: tuple[str, ...] = ()  # the installed distributions the registry import loaded
    read: bool = True  # False: nothing was read (a build of CPU variants only), so nothing is known


# --- what an import loaded (the plan cache's inputs) -----------------------------------------------------------

def interpreter_dirs() -> tuple[Path, ...]:
    """The standard library's and site-packages' directories: covered by the Python version and ``dists``."""
    paths = sysconfig.get_paths()
    return tuple({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def local_module_files(modules: Iterable[str]) -> list[Path]:
    """The files of ``modules`` (names in ``sys.modules``) that live outside the interpreter's directories."""
    shared = interpreter_dirs()
    files = set()
    for name in modules:
        location = getattr(sys.modules.get(name), "__file__", None)
        if not location or not Path(location).is_file():
            continue  # built in, frozen, or a namespace package
        path = Path(location).resolve()
        if not any(path.is_relative_to(d) for d in shared):
            files.add(path)
    return sorted(files)


def distributions_of(modules: Iterable[str]) -> dict[str, str]:
    """{distribution: version} of the installed distributions that provide ``modules``' top-level packages.

    Only packages installed in the interpreter's own directories count: a package vendored inside another
    (setuptools' ``_vendor``, put on ``sys.path`` for a moment) is covered by the version of the one that ships it.
    """
    shared = interpreter_dirs()
    tops = set()
    for name in {m.partition(".")[0] for m in modules}:
        location = getattr(sys.modules.get(name), "__file__", None)
        path = Path(location).resolve() if location else None
        if path and any(path.is_relative_to(d) and path.relative_to(d).parts[0].startswith(name) for d in shared):
            tops.add(name)
    provided = packages_distributions()
    names = {d for top in tops for d in provided.get(top, ())}
    return {d: installed_version(d) for d in sorted(names)}


def installed_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


# --- records <-> JSON --------------------------------------------------------------------------------------------

_SCALARS = (bool, int, float, str)


def _encode(value: Any) -> Any:
    """A constexpr or option as JSON: itself when JSON keeps its type, else its repr (and its JSON form when it is
    a scalar of a derived type, an IntEnum say, which the manifest's launch fields write as the scalar)."""
    if value is None or type(value) in _SCALARS:
        return value
    return {"repr": repr(value), "scalar": json.loads(json.dumps(value)) if isinstance(value, _SCALARS) else None}


def _decode(value: Any) -> Any:
    return OpaqueValue(value["repr"], value["scalar"]) if isinstance(value, dict) else value


def _values(values: Mapping[str, Any], code: Any) -> dict[str, Any]:
    return {name: code(value) for name, value in values.items()}


def _special_json(special: SpecializationRecord) -> dict[str, Any]:
    return {"name": special.name, "signature": dict(special.signature),
            "constexprs": _values(special.constexprs, _encode), "backends": list(special.backends),
            "min_arch": dict(special.min_arch), "options": _values(special.options, _encode),
            "aligned": list(special.aligned)}


def kernel_json(kernel: KernelRecord) -> dict[str, Any]:
    """A record as the guest sends it (the callables reduced to data)."""
    csrc = kernel.csrc
    return {"name": kernel.name, "module": kernel.module,
            "supported": {backend: list(archs) for backend, archs in kernel.supported.items()},
            "triton": [{"name": e.name, "fn_module": e.fn_module, "specializations": [_special_json(s) for s in
                                                                                       e.specializations]}
                       for e in kernel.triton],
            "csrc": None if csrc is None else {"name": csrc.name, "sources": list(csrc.sources),
                                               "supported": list(csrc.supported), "library": csrc.library},
            "bench_cases": kernel.bench_cases is not None, "description": kernel.description}


def _special(data: dict[str, Any]) -> SpecializationRecord:
    return SpecializationRecord(
        name=data["name"], signature=FrozenMap(data["signature"]),
        constexprs=FrozenMap(_values(data["constexprs"], _decode)), backends=tuple(data["backends"]),
        min_arch=FrozenMap(data["min_arch"]), options=FrozenMap(_values(data["options"], _decode)),
        aligned=tuple(data["aligned"]))


def kernel_record(data: dict[str, Any]) -> KernelRecord:
    """A record back from its JSON: ``fn`` None, ``bench_cases`` None (the data says whether it had one)."""
    csrc = data["csrc"]
    return KernelRecord(
        name=data["name"], module=data["module"],
        supported=FrozenMap({backend: tuple(archs) for backend, archs in data["supported"].items()}),
        triton=tuple(TritonRecord(e["name"], None, tuple(_special(s) for s in e["specializations"]), e["fn_module"])
                     for e in data["triton"]),
        csrc=None if csrc is None else CudaSourceRecord(csrc["name"], tuple(csrc["sources"]),
                                                        tuple(csrc["supported"]), csrc["library"]),
        description=data["description"])


def registry_data(payload: dict[str, Any]) -> RegistryData:
    kernels = payload["kernels"]
    return RegistryData(tuple(kernel_record(k) for k in kernels),
                        tuple(k["name"] for k in kernels if k["bench_cases"]),
                        tuple(payload["modules"]), tuple(payload["dists"]))


# --- the parent ----------------------------------------------------------------------------------------------------

def guest_reads(config: KilnConfig) -> list[Path]:
    """What the guest reads beside the interpreters and Kiln's code: the project (kiln.toml's folder) and the
    folder the package is imported from."""
    return [config.config_file.resolve().parent, config.import_root, config.path(config.project.source)]


def load_registry_data(config: KilnConfig, timeout_s: float = REGISTRY_TIMEOUT_S) -> RegistryData:
    """The registry's records, imported, called and validated by a sandboxed guest (see the module docstring).

    Raises :class:`ConfigError`: the child's own (the registry cannot be imported, raises, or returns
    something the validation refuses), or one naming the entry point when the child dies or runs too long.
    """
    entry = config.project.registry
    if entry is None:  # a project built by its own backend, with nothing for Kiln to compile
        return RegistryData(())
    with tempfile.TemporaryDirectory(prefix="kiln-registry-") as scratch:
        result = Path(scratch) / "registry.json"
        request = json.dumps({"source": dataclasses.asdict(registry_source(config)), "path": list(sys.path)})
        # -P: the directory Kiln runs in is never on the guest's import path.
        cmd = guest_command([sys.executable, "-P", "-m", GUEST_MODULE, request, str(result)],
                            read=guest_reads(config), write=[scratch], network="none")
        env = guest_environ(Path(scratch) / "home", {"PYTHONDONTWRITEBYTECODE": "1"})
        ladder, output = run_in_group(cmd, timeout_s, env=env, grace_s=_GRACE_S)
        tail = output[-2000:].strip()
        if ladder.timed_out:
            raise ConfigError(f"project.registry = {entry!r}: importing it (in its sandbox) ran past its"
                              f" {timeout_s:g} s deadline; ended by {ladder.escalation}:\n{tail}")
        try:
            payload = json.loads(result.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"project.registry = {entry!r}: importing it (in its sandbox) ended with exit status"
                              f" {ladder.returncode} and no result ({type(exc).__name__}):\n{tail}") from None
    if "error" in payload:
        raise ConfigError(payload["error"])
    return registry_data(payload)


# --- the guest -------------------------------------------------------------------------------------------------

def _guest(source: RegistrySource) -> dict[str, Any]:
    before = set(sys.modules)
    try:
        kernels = [kernel_json(k) for k in load_registry(source)]
    except ConfigError as exc:
        return {"error": str(exc)}
    loaded = set(sys.modules) - before
    return {"kernels": kernels, "modules": [str(p) for p in local_module_files(list(sys.modules))],
            "dists": sorted(distributions_of(loaded))}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -P -m {GUEST_MODULE} REQUEST_JSON RESULT_FILE", file=sys.stderr)
        return 2
    request = json.loads(argv[0])
    sys.path[:] = [p for p in request["path"] if os.path.isabs(p)]  # "" or "." would be the working directory
    payload = _guest(RegistrySource(**request["source"]))
    Path(argv[1]).write_text(json.dumps(payload, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
