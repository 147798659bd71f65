"""The ``kiln-runtime`` wheel, published beside the kernel wheels that import it.

A package built by Kiln imports ``kiln.runtime`` (its spec types, the loader
of its precompiled artifacts) and lists ``kiln-runtime`` in its
dependencies, so an index that carries the kernel wheels must carry this one
too, or ``pip install`` of a kernel wheel cannot resolve. It is packed from
the ``kiln.runtime`` this Kiln runs (the code the test stage tested the
wheels against), with one fixed timestamp: its bytes depend on its sources
alone, so every run of one ``kiln-runtime`` version writes the same wheel and
re-publishing it is a no-op, while a changed source under an unchanged
version is refused as a conflict (bump the version).
"""

from __future__ import annotations

import email.message
from importlib import metadata
from pathlib import Path
from typing import cast

from kiln.core.errors import ConfigError
from kiln.tasks.wheel.assemble import _CACHE_SUFFIXES, _CACHES, WheelStamp, wheel_filename, wheel_metadata, write_wheel

DISTRIBUTION = "kiln-runtime"


def _package_root() -> Path:
    import kiln.runtime

    return Path(kiln.runtime.__file__).parent


def _sources(root: Path) -> list[tuple[str, bytes]]:
    """Every file of the ``kiln/runtime`` package (caches aside), by its path inside the wheel."""
    files = [p for p in root.rglob("*") if p.is_file() and not _CACHES & set(p.relative_to(root).parts)
             and p.suffix not in _CACHE_SUFFIXES]
    return [(f"kiln/runtime/{p.relative_to(root).as_posix()}", p.read_bytes()) for p in sorted(files)]


def _metadata(dist: metadata.Distribution) -> str:
    meta = cast(email.message.Message, dist.metadata)  # what importlib.metadata returns, with .get
    lines = ["Metadata-Version: 2.1", f"Name: {meta['Name']}", f"Version: {meta['Version']}"]
    lines += [f"Summary: {meta['Summary']}"] if meta.get("Summary") else []
    lines += [f"Requires-Python: {meta['Requires-Python']}"] if meta.get("Requires-Python") else []
    lines += [f"Requires-Dist: {r}" for r in dist.requires or []]
    return "\n".join(lines) + "\n"


def build_runtime_wheel(out_dir: Path) -> Path:
    """Write ``kiln_runtime-<version>-py3-none-any.whl`` into ``out_dir`` and return its path."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise ConfigError(f"{DISTRIBUTION} is not installed beside Kiln, so its wheel cannot be published "
                          f"(install it: pip install -e ./runtime), or set [project] runtime = false "
                          f"in kiln.toml if the package does not import kiln.runtime") from exc
    version = dist.metadata["Version"]
    filename = wheel_filename(DISTRIBUTION, version, "py3-none-any")
    dist_info = f"{filename.split('-')[0]}-{version}.dist-info"
    members = _sources(_package_root())
    members += [(f"{dist_info}/METADATA", _metadata(dist).encode()),
                (f"{dist_info}/WHEEL", wheel_metadata("py3-none-any", pure=True).encode())]
    return write_wheel(out_dir, filename, members, WheelStamp())
