"""A stored build plan, reused while nothing it was made from has changed (no Prefect here).

Planning imports the project's kernel registry, and with it torch and Triton
(in a guest: :mod:`kiln.tasks.project.registry_guest`): seconds, against
milliseconds for everything else a warm build does. The plan
is a pure function of its inputs, so :func:`store` keeps it beside the build
cache and :func:`load` gives it back only when every input still hashes the
same — the way the build cache serves an artifact only after re-hashing it.

Layout: ``<cache root>/plans/<key>.json``. The key names what a caller asks
for (kiln.toml's path and bytes, the variants, the nvcc path, the Python and
its environment, the formats of the plan and of the build cache); the entry
records what the plan was made from, each checked on every load:

- ``tree``: every file of the package directory, by content hash, so a new,
  edited or deleted kernel source, header or data file replans (and, for
  ``[build] backend = "pep517"``, ``project``: the project's own hash);
- ``modules``: every module loaded at planning time, by Kiln or by the
  registry's guest, from outside the interpreter's own directories (Kiln's
  planner, the registry's helpers beside the package), by content hash;
- ``dists``: the version of every distribution the registry import loaded
  (torch, Triton, numpy, ...), read with :mod:`importlib.metadata` — no import;
- ``toolchain`` and ``missing``: the caller compares them with what it finds
  now (nvcc's version is asked of nvcc on every build).

Beside the plans, ``registry/<key>.json`` (keyed by kiln.toml and the
interpreter only) keeps what a read of the registry found beyond the plan —
which kernels declare bench cases — with the same inputs, checked the same way,
for a stage that must not import the registry (the bench stage).

An entry that cannot be read is a warning and a replan, never an error; one
whose inputs differ is replaced by the next :func:`store`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.fsutil import atomic_write_text, digest, sha256_file
from kiln.tasks.build.nvcc import NvccSettings
from kiln.tasks.build.plan import CACHE_FORMAT, BuildPlan, CompileUnit, Skip, VariantPlan, kiln_state
from kiln.tasks.build.reproducible import BUILD_RECIPE
from kiln.tasks.build.sources import project_hash
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.project.registry_guest import installed_version, local_module_files
from kiln.tasks.project.registry_types import CudaSourceRecord

_log = logging.getLogger(__name__)

# Bump when the entry's layout or the meaning of a plan changes: old entries then miss.
PLAN_FORMAT = "kiln-plan-1"
_CACHES = {"__pycache__"}
_CACHE_SUFFIXES = {".pyc", ".pyo"}


@dataclass(frozen=True)
class StoredPlan:
    """What planning produced from the registry: the plan, and what the nvcc backend needs of it."""

    plan: BuildPlan
    csrc: Mapping[str, CudaSourceRecord]  # kernel -> its CUDA sources (empty: nvcc is not needed)
    settings: NvccSettings
    toolchain: dict[str, str]  # what the plan was made with, nvcc's version included
    missing: str  # why CUDA C++ units could not build then, or ""


def plan_key(config: KilnConfig, variants: list[str] | None, nvcc_path: str | None) -> str:
    """The entry a request maps to; every input listed in the module docstring is checked inside it."""
    path = config.config_file.resolve()
    return digest(PLAN_FORMAT, CACHE_FORMAT, BUILD_RECIPE, str(path), path.read_bytes().hex(), repr(variants),
                  repr(nvcc_path), sys.version, sys.prefix, str(config.root))


def _entry_path(root: Path, key: str) -> Path:
    return root / "plans" / f"{key}.json"


def stored(root: Path, key: str) -> bool:
    """Whether a plan is stored under ``key`` (unchecked: :func:`load` decides whether it still holds)."""
    return _entry_path(root, key).is_file()


def tree_hashes(package_dir: Path) -> dict[str, str]:
    """Every file under ``package_dir`` but bytecode caches: {relative POSIX path: sha256}."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _CACHES)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix not in _CACHE_SUFFIXES:
                out[path.relative_to(package_dir).as_posix()] = sha256_file(path)
    return out


def _inputs(config: KilnConfig, module_files: Iterable[Path], dists: Iterable[str]) -> dict[str, Any]:
    package_dir = config.path(config.project.source)
    pep517 = config.build.backend == "pep517"
    return {"tree": tree_hashes(package_dir) if package_dir.is_dir() else {},
            "project": project_hash(config.path(config.build.project_dir), kiln_state(config)) if pep517 else "",
            "modules": {str(p): sha256_file(p) if p.is_file() else "absent" for p in module_files},
            "dists": {d: installed_version(d) for d in dists}}


def store(root: Path, key: str, config: KilnConfig, stored: StoredPlan, module_files: Iterable[str | Path] = (),
          dists: Iterable[str] = ()) -> None:
    """Keep ``stored`` under ``key``. ``module_files``: the local modules the registry's guest loaded (beside
    those this process loaded); ``dists``: the distributions its import loaded (its third-party inputs)."""
    files = sorted(set(local_module_files(list(sys.modules))) | {Path(f) for f in module_files})
    inputs = _inputs(config, files, sorted(set(dists)))
    entry = {"format": PLAN_FORMAT, "key": key, "inputs": inputs, "plan": dataclasses.asdict(stored.plan),
             "csrc": {k: dataclasses.asdict(v) for k, v in stored.csrc.items()},
             "settings": dataclasses.asdict(stored.settings), "toolchain": stored.toolchain,
             "missing": stored.missing}
    try:
        atomic_write_text(_entry_path(root, key), json.dumps(entry, indent=1, sort_keys=True) + "\n")
    except OSError as exc:  # a read-only cache still builds; the next build plans again
        _log.warning("could not store the build plan in %s (%s); the next build plans again", root, exc)


def load(root: Path, key: str, config: KilnConfig) -> StoredPlan | None:
    """The stored plan of ``key`` if every input it records is unchanged; None on a miss or a change.

    An unreadable entry is logged as a warning and treated as a miss: the caller replans and overwrites it.
    """
    path = _entry_path(root, key)
    try:
        entry = json.loads(path.read_text())
        recorded = entry["inputs"]
        if entry["format"] != PLAN_FORMAT or entry["key"] != key:
            raise ValueError(f"format {entry['format']!r}, key {str(entry['key'])[:16]}")
        stored = _stored_from(entry)
        changed = _changed(config, recorded)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _log.warning("stored build plan %s is unreadable (%s: %s); planning again", path, type(exc).__name__, exc)
        return None
    if changed:
        _log.info("stored build plan %s is out of date (%s changed); planning again", key[:16], ", ".join(changed))
        return None
    return stored


def _changed(config: KilnConfig, recorded: dict[str, Any]) -> list[str]:
    """The inputs (tree, project, modules, dists) that differ now from ``recorded``."""
    now = _inputs(config, map(Path, recorded["modules"]), recorded["dists"])
    return [k for k in ("tree", "project", "modules", "dists") if now[k] != recorded[k]]


# --- what the registry declares beyond the plan: read by stages that must not import it ---------------------------

def _facts_path(root: Path, config: KilnConfig) -> Path:
    path = config.config_file.resolve()
    key = digest(PLAN_FORMAT, "registry-facts", str(path), path.read_bytes().hex(), sys.version, sys.prefix,
                 str(config.root))
    return root / "registry" / f"{key}.json"


def store_bench_kernels(root: Path, config: KilnConfig, kernels: Iterable[str], module_files: Iterable[str | Path],
                        dists: Iterable[str]) -> None:
    """Keep which kernels the registry's read found declaring ``bench_cases``, with that read's inputs."""
    inputs = _inputs(config, sorted({Path(f) for f in module_files}), sorted(set(dists)))
    entry = {"format": PLAN_FORMAT, "inputs": inputs, "bench_kernels": sorted(kernels)}
    try:
        atomic_write_text(_facts_path(root, config), json.dumps(entry, indent=1, sort_keys=True) + "\n")
    except OSError as exc:  # a read-only cache: the bench stage then measures as it would without the record
        _log.warning("could not record the registry's bench kernels in %s (%s)", root, exc)


def bench_kernels(root: Path, config: KilnConfig) -> tuple[str, ...] | None:
    """The kernels that declare ``bench_cases``, as the last read of the registry recorded them; None when no read
    is recorded, the record is unreadable or anything it was read from changed since (then nobody knows)."""
    try:
        entry = json.loads(_facts_path(root, config).read_text())
        if entry["format"] != PLAN_FORMAT or _changed(config, entry["inputs"]):
            return None
        return tuple(str(k) for k in entry["bench_kernels"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _log.warning("the registry's bench kernels in %s are unreadable (%s: %s)", root, type(exc).__name__, exc)
        return None


def _stored_from(entry: dict[str, Any]) -> StoredPlan:
    """The entry's JSON back into the planner's frozen types (tuples where they hold tuples)."""
    plan = entry["plan"]
    variants = tuple(
        VariantPlan(v["name"], v["backend"],
                    tuple(CompileUnit(**{**u, "archs": tuple(u["archs"])}) for u in v["units"]),
                    tuple(Skip(**s) for s in v["skips"]))
        for v in plan["variants"])
    csrc = {k: CudaSourceRecord(v["name"], tuple(v["sources"]), tuple(v["supported"]), v["library"])
            for k, v in entry["csrc"].items()}
    settings = NvccSettings(**{k: tuple(v) for k, v in entry["settings"].items()})
    toolchain = {str(k): str(v) for k, v in entry["toolchain"].items()}
    return StoredPlan(BuildPlan(dict(plan["toolchain"]), variants), csrc, settings, toolchain,
                      str(entry["missing"]))
