"""One wheel per variant: the package's sources, its compiled artifacts and their manifest.

Written with ``wheel.wheelfile.WheelFile`` (which hashes every member into
``RECORD``); names, versions and tags go through ``packaging``. Compiled
artifacts land under ``<package>/_aot/`` beside ``manifest.json``, the list
the package's loader reads. A variant with binaries gets a platform tag
(``py3-none-<platform>``: the artifacts are not tied to a CPython ABI); the
``cpu`` variant compiles nothing and is tagged ``py3-none-any`` (unless the
package vendors a shared library, which every wheel keeps).

Reproducible: two builds of one commit give byte-identical wheels. Every
member (RECORD included) carries one timestamp — ``SOURCE_DATE_EPOCH`` when
set, else the commit's time — and members are written in sorted order. The
platform tag is honest and the same on every worker: the manylinux tag
``auditwheel``'s analysis of the wheel's binaries allows
(:mod:`kiln.tasks.wheel.manylinux`), else ``linux_<machine>``.

Given the build cache, a wheel is written once per content: its key hashes the
file name, the stamp and every member's name and sha256 in order, and a warm
build whose members are unchanged copies the stored wheel (its sha256 checked
on the way out) instead of deflating them again. The bytes are the same as a
fresh write's, since the writer is deterministic in exactly those inputs.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from wheel.wheelfile import WheelFile

from kiln.core.errors import ConfigError, InvalidInputError
from kiln.core.fsutil import atomic_write_bytes, digest, sha256_bytes
from kiln.tasks.project.config import KilnConfig, Variant
from kiln.tasks.wheel.abi_audit import audit_members, check_claims
from kiln.tasks.wheel.manylinux import linux_platform, manylinux_tag
from kiln.tasks.wheel.sbom import sbom_arcname, wheel_sbom
from kiln.tasks.wheel.stable_abi import torch_specifier
from kiln.tasks.wheel.stored import ResultCache

_log = logging.getLogger(__name__)
ZIP_EPOCH = 315532800  # 1980-01-01: the earliest time a zip member can carry
_CACHES = {"__pycache__"}
_CACHE_SUFFIXES = {".pyc", ".pyo"}
_BINARY_SUFFIXES = (".so", ".pyd", ".dylib")
AOT_DIR = "_aot"  # Kiln's: what is there in the source tree is a stale local build, never shipped


@dataclass(frozen=True)
class WheelInput:
    """One file for ``<package>/_aot/``: where it is now, and its path inside ``_aot``."""

    source: Path
    arcpath: str


@dataclass(frozen=True)
class WheelStamp:
    """What makes a wheel reproducible and traceable: its one timestamp and the commit it was built from."""

    epoch: int = ZIP_EPOCH
    commit: str = ""
    toolchain: tuple[tuple[str, str], ...] = ()  # (tool, version) the binaries were compiled with

    @classmethod
    def for_commit(cls, commit: str, commit_time: int, toolchain: dict[str, str] | None = None,
                   environ: dict[str, str] | None = None) -> WheelStamp:
        env = os.environ if environ is None else environ
        epoch = int(env["SOURCE_DATE_EPOCH"]) if env.get("SOURCE_DATE_EPOCH", "").strip().isdigit() else commit_time
        return cls(max(epoch, ZIP_EPOCH), commit, tuple(sorted((toolchain or {}).items())))

    @property
    def date_time(self) -> tuple[int, int, int, int, int, int]:
        return time.gmtime(self.epoch)[:6]


def platform_tag() -> str:
    """``linux_x86_64`` style: what the build machine is, claiming no manylinux compatibility (until
    :func:`kiln.tasks.wheel.manylinux.manylinux_tag` has judged the wheel's binaries)."""
    return linux_platform()


def wheel_filename(distribution: str, version: str, tag: str) -> str:
    name = canonicalize_name(distribution).replace("-", "_")
    try:
        filename = f"{name}-{Version(version)}-{tag}.whl"
        parse_wheel_filename(filename)  # refuses anything that is not PEP 427
    except (InvalidVersion, InvalidWheelFilename) as exc:
        raise InvalidInputError(f"cannot name a wheel for {distribution!r} {version!r} {tag!r}: {exc}") from exc
    return filename


def _pin(reqs: list[Requirement], name: str, version: str, specifier: str | None = None) -> list[Requirement]:
    """``reqs`` with ``name``'s line replaced by ``name==version`` (or ``name<specifier>``), its marker kept."""
    pinned = [r for r in reqs if canonicalize_name(r.name) == name]
    marker = f"; {pinned[0].marker}" if pinned and pinned[0].marker else ""
    wanted = specifier or f"=={version}"
    return [r for r in reqs if canonicalize_name(r.name) != name] + [Requirement(f"{name}{wanted}{marker}")]


def requirements(config: KilnConfig, variant: Variant, toolchain: dict[str, str], compiled: bool,
                 torch_extension: bool = False, base: tuple[str, ...] | None = None,
                 audited_torch: str | None = None) -> list[str]:
    """The variant's Requires-Dist: the project's (``base``: a backend-built wheel's own), then the
    variant's; a variant with Triton binaries pins the Triton that compiled them (a cubin only
    loads under it), one with a torch extension the torch release series it was built against (``==2.14.*``:
    torch's C++ ABI holds within one), or for an ``abi = "stable"`` variant ``>=`` its floor (its target or
    ``audited_torch``, the minimum torch the ABI audit found, whichever is higher:
    :func:`kiln.tasks.wheel.stable_abi.torch_specifier`)."""
    # Validated when kiln.toml was loaded; str() spells each one the canonical way.
    project = config.project.dependencies if base is None else base
    reqs = [Requirement(r) for r in (*project, *variant.dependencies)]
    triton = toolchain.get("triton", "absent")
    if compiled and variant.backend != "cpu" and triton != "absent":
        reqs = _pin(reqs, "triton", triton)
    torch = toolchain.get("torch", "absent")
    if torch_extension and torch != "absent":
        reqs = _pin(reqs, "torch", torch, torch_specifier(variant.abi == "stable", torch, variant.torch_target,
                                                          audited_torch))
    if config.project.ships_runtime and any(canonicalize_name(r.name) == RUNTIME for r in reqs):
        # exactly the kiln-runtime published beside it: no other version, from no other index, can satisfy it
        reqs = _pin(reqs, RUNTIME, runtime_version())
    return [str(r) for r in reqs]


RUNTIME = "kiln-runtime"


def runtime_version() -> str:
    """The version of the ``kiln-runtime`` wheel a run publishes beside its wheels (the one this Kiln runs)."""
    try:
        return str(Version(metadata.version(RUNTIME)))
    except metadata.PackageNotFoundError as exc:
        raise ConfigError(f"{RUNTIME} is not installed beside Kiln, so the wheels cannot require the one published "
                          f"beside them (install it: pip install -e ./runtime), or set [project] runtime = false "
                          f"in kiln.toml if the package does not import kiln.runtime") from exc


def metadata_text(config: KilnConfig, version: str, requires: list[str]) -> str:
    project = config.project
    lines = ["Metadata-Version: 2.1", f"Name: {project.distribution}", f"Version: {version}",
             f"Summary: {project.package} kernels built by Kiln", f"Requires-Python: {project.requires_python}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def build_info(variant: Variant, stamp: WheelStamp) -> str:
    """``<dist-info>/kiln_build.json``: the commit and toolchain a wheel was built from."""
    info = {"commit": stamp.commit, "source_date_epoch": stamp.epoch, "variant": variant.name,
            "toolchain": dict(stamp.toolchain)}
    return json.dumps(info, indent=2, sort_keys=True) + "\n"


def package_files(config: KilnConfig) -> list[tuple[Path, str]]:
    """The package's own files (sources, data, vendored binaries), without caches.

    Left out, each named in a warning: ``[build] exclude`` matches (globs
    relative to the package directory) and anything under ``_aot/``, which is
    Kiln's to write.
    """
    root = config.path(config.project.source)
    out, excluded = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _CACHES and not d.startswith("."))
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            relative = path.relative_to(root).as_posix()
            if path.suffix in _CACHE_SUFFIXES or filename.startswith("."):
                continue
            if relative.split("/")[0] == AOT_DIR or any(fnmatch.fnmatch(relative, p) for p in config.build.exclude):
                excluded.append(relative)
                continue
            out.append((path, f"{config.project.package.replace('.', '/')}/{relative}"))
    if excluded:
        _log.warning("left out of the %s wheel (build.exclude, or Kiln's own _aot/): %s", config.project.distribution,
                     ", ".join(excluded[:20]) + (f" and {len(excluded) - 20} more" if len(excluded) > 20 else ""))
    return out


def ships_binaries(files: list[tuple[Path, str]]) -> bool:
    return any(arcname.endswith(_BINARY_SUFFIXES) for _, arcname in files)


def _info(arcname: str, stamp: WheelStamp) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(arcname, date_time=stamp.date_time)
    info.external_attr, info.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
    return info


class _StampedWheelFile(WheelFile):  # type: ignore[misc]  # the wheel package ships no type hints
    """A ``WheelFile`` for writing whose every member carries the stamp's time and mode: RECORD
    too, which ``WheelFile`` names by its path alone and would date with the clock."""

    def __init__(self, path: Path, stamp: WheelStamp) -> None:
        super().__init__(path, "w")
        self.stamp = stamp

    # Any: as zipfile.ZipFile.writestr takes them (str or ZipInfo; bytes or str)
    def writestr(self, zinfo_or_arcname: Any, data: Any, compress_type: int | None = None) -> None:
        if isinstance(zinfo_or_arcname, str):
            zinfo_or_arcname = _info(zinfo_or_arcname, self.stamp)
        super().writestr(zinfo_or_arcname, data, compress_type)


def build_wheel(config: KilnConfig, version: str, binaries: list[WheelInput], entries: list[dict[str, Any]],
                out_dir: Path, *, variant: Variant, stamp: WheelStamp = WheelStamp(),
                cache: ResultCache | None = None) -> Path:
    """Write the variant's wheel into ``out_dir`` atomically and return its path."""
    sources = package_files(config)
    pure = variant.backend == "cpu" and not ships_binaries(sources)
    tag = "py3-none-any" if pure else f"py3-none-{platform_tag()}"
    filename = wheel_filename(config.project.distribution, version, tag)
    package = config.project.package
    dist_info = f"{filename.split('-')[0]}-{Version(version)}.dist-info"
    torch_extension = config.build.toolchain.torch and any(b.arcpath.endswith(".so") for b in binaries)
    members = [(arcname, path.read_bytes()) for path, arcname in sources]
    members += [(f"{package}/_aot/{item.arcpath}", item.source.read_bytes())
                for item in sorted(binaries, key=lambda b: b.arcpath)]
    if variant.backend != "cpu":
        manifest = json.dumps(sorted(entries, key=lambda e: e["path"]), indent=2, sort_keys=True) + "\n"
        members.append((f"{package}/_aot/manifest.json", manifest.encode()))
    sbom = wheel_sbom(config.project.distribution, version, variant, stamp.commit, stamp.epoch, stamp.toolchain,
                      members, cache)
    audited_torch = None
    if not pure:  # the tag its binaries allow (the dist-info's name does not depend on it)
        tag = manylinux_tag(tag, members, variant.backend, cache, config.build.manylinux)
        filename = wheel_filename(config.project.distribution, version, tag)
        # the ABI it claims, kept before it is written (an AbiAuditError naming the symbols)
        audited_torch = check_claims(audit_members(filename, tag, members, torch_stable=variant.abi == "stable",
                                                   cache=cache)).min_torch
    requires = requirements(config, variant, dict(stamp.toolchain), compiled=bool(binaries),
                            torch_extension=torch_extension, audited_torch=audited_torch)
    members += [(f"{dist_info}/METADATA", metadata_text(config, version, requires).encode()),
                (f"{dist_info}/kiln_build.json", build_info(variant, stamp).encode()),
                (sbom_arcname(dist_info), sbom),
                (f"{dist_info}/WHEEL", wheel_metadata(tag, pure).encode())]
    final = write_wheel(out_dir, filename, members, stamp, cache=cache)
    _log.info("wrote %s (%d compiled artifacts, commit %s)", final, len(entries), stamp.commit[:12] or "none")
    return final


def wheel_metadata(tag: str, pure: bool) -> str:
    return f"Wheel-Version: 1.0\nGenerator: kiln\nRoot-Is-Purelib: {'true' if pure else 'false'}\nTag: {tag}\n"


# Bump when the writer's output for the same members changes (member order, zip settings, RECORD).
WHEEL_CACHE_FORMAT = "1"
_WHEEL_BATCH = "wheels"


def wheel_key(filename: str, members: list[tuple[str, bytes]], stamp: WheelStamp) -> str:
    """What a written wheel's bytes depend on: the writer, zlib, the name, the stamp, each member in order."""
    return digest(WHEEL_CACHE_FORMAT, zlib.ZLIB_RUNTIME_VERSION, filename, repr(stamp.date_time),
                  *(f"{arcname}\0{sha256_bytes(data)}" for arcname, data in members))


def write_wheel(out_dir: Path, filename: str, members: list[tuple[str, bytes]], stamp: WheelStamp,
                cache: ResultCache | None = None) -> Path:
    """Write ``members`` (arcname, bytes), in order, as ``out_dir/filename`` atomically; RECORD by WheelFile.

    With ``cache``, a wheel of the same key is copied from it (verified) and a new one is stored there.
    """
    if cache is None:
        return _write_archive(out_dir, filename, members, stamp)
    key = wheel_key(filename, members, stamp)
    stored = cache.file(_WHEEL_BATCH, key, filename)
    if stored is not None:
        atomic_write_bytes(out_dir / filename, stored, durable=False)  # a copy of the cache's, as the units
        return out_dir / filename
    final = _write_archive(out_dir, filename, members, stamp)
    cache.put(_WHEEL_BATCH, key, {filename: final.read_bytes()}, {"kind": "wheel"})
    return final


def _write_archive(out_dir: Path, filename: str, members: list[tuple[str, bytes]], stamp: WheelStamp) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    # WheelFile insists on a PEP 427 file name, so the temporary copy gets the
    # real name inside a private directory, then one rename publishes it.
    staging = Path(tempfile.mkdtemp(prefix=".wheel-", dir=out_dir))
    try:
        with _StampedWheelFile(staging / filename, stamp) as archive:
            for arcname, data in members:
                archive.writestr(arcname, data)
        final = out_dir / filename
        os.replace(staging / filename, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
