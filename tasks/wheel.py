"""One wheel per variant: the package's sources, its compiled artifacts and their manifest.

Written with ``wheel.wheelfile.WheelFile`` (which hashes every member into
``RECORD``); names, versions and tags go through ``packaging``. Compiled
artifacts land under ``<package>/_aot/`` beside ``manifest.json``, the list
the package's loader reads. A variant with binaries gets a platform tag
(``py3-none-<platform>``: the artifacts are not tied to a CPython ABI); the
``cpu`` variant ships no binaries and is tagged ``py3-none-any``.
Members get a fixed timestamp so the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from wheel.wheelfile import WheelFile

from release.errors import ConfigError, InvalidInputError
from tasks.config import KilnConfig

_log = logging.getLogger("kiln.wheel")
_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIP_DIRS = {"__pycache__", "_aot"}
_SKIP_SUFFIXES = {".pyc", ".pyo", ".so", ".cubin", ".hsaco"}


@dataclass(frozen=True)
class WheelInput:
    """One file for ``<package>/_aot/``: where it is now, and its path inside ``_aot``."""

    source: Path
    arcpath: str


def platform_tag() -> str:
    return next(iter(sys_tags())).platform


def wheel_filename(distribution: str, version: str, tag: str) -> str:
    name = canonicalize_name(distribution).replace("-", "_")
    try:
        filename = f"{name}-{Version(version)}-{tag}.whl"
        parse_wheel_filename(filename)  # refuses anything that is not PEP 427
    except (InvalidVersion, InvalidWheelFilename) as exc:
        raise InvalidInputError(f"cannot name a wheel for {distribution!r} {version!r} {tag!r}: {exc}") from exc
    return filename


def metadata_text(config: KilnConfig, version: str) -> str:
    project = config.project
    try:
        SpecifierSet(project.requires_python)
        requires = [str(Requirement(r)) for r in project.dependencies]
    except (InvalidSpecifier, InvalidRequirement) as exc:
        raise ConfigError(f"project.requires_python / dependencies: {exc}") from exc
    lines = ["Metadata-Version: 2.1", f"Name: {project.distribution}", f"Version: {version}",
             f"Summary: {project.package} kernels built by Kiln", f"Requires-Python: {project.requires_python}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def _package_sources(config: KilnConfig) -> list[tuple[Path, str]]:
    """The package's own files (sources, data), without caches or dev-built binaries."""
    root = config.path(config.project.source)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            if path.suffix in _SKIP_SUFFIXES or filename.startswith("."):
                continue
            out.append((path, f"{config.project.package}/{path.relative_to(root).as_posix()}"))
    return out


def _add(archive: WheelFile, arcname: str, data: bytes) -> None:
    info = zipfile.ZipInfo(arcname, date_time=_EPOCH)
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, data)


def build_wheel(config: KilnConfig, version: str, binaries: list[WheelInput], entries: list[dict[str, Any]],
                out_dir: Path, pure: bool) -> Path:
    """Write the wheel into ``out_dir`` atomically and return its path."""
    tag = "py3-none-any" if pure else f"py3-none-{platform_tag()}"
    filename = wheel_filename(config.project.distribution, version, tag)
    package = config.project.package
    dist_info = f"{filename.split('-')[0]}-{Version(version)}.dist-info"
    out_dir.mkdir(parents=True, exist_ok=True)
    # WheelFile insists on a PEP 427 file name, so the temporary copy gets the
    # real name inside a private directory, then one rename publishes it.
    staging = Path(tempfile.mkdtemp(prefix=".wheel-", dir=out_dir))
    try:
        with WheelFile(staging / filename, "w") as archive:
            for path, arcname in _package_sources(config):
                _add(archive, arcname, path.read_bytes())
            for item in sorted(binaries, key=lambda b: b.arcpath):
                _add(archive, f"{package}/_aot/{item.arcpath}", item.source.read_bytes())
            if not pure:
                manifest = json.dumps(sorted(entries, key=lambda e: e["path"]), indent=2, sort_keys=True) + "\n"
                _add(archive, f"{package}/_aot/manifest.json", manifest.encode())
            _add(archive, f"{dist_info}/METADATA", metadata_text(config, version).encode())
            wheel_meta = (f"Wheel-Version: 1.0\nGenerator: kiln\nRoot-Is-Purelib: {'true' if pure else 'false'}\n"
                          f"Tag: {tag}\n")
            _add(archive, f"{dist_info}/WHEEL", wheel_meta.encode())
        final = out_dir / filename
        os.replace(staging / filename, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log.info("wrote %s (%d compiled artifacts)", final, len(entries))
    return final
