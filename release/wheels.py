"""Read a wheel for an index: its hash, size and core metadata (the PEP 658 sidecar)."""

from __future__ import annotations

import io
import zipfile
from email.parser import BytesHeaderParser
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.release.dists import Distribution, make_distribution, parse_filename
from kiln.release.errors import InvalidInputError
from kiln.release.fsutil import sha256_bytes


def core_metadata(filename: str, data: bytes) -> bytes:
    """The bytes of ``<name>-<version>.dist-info/METADATA`` inside a wheel.

    The metadata must name the same project and version as the filename: a
    sidecar that disagrees with its wheel would make resolvers pick wrong.
    """
    project, version = parse_filename(filename)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            candidates = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(candidates) != 1:
                raise InvalidInputError(f"{filename}: expected one top-level *.dist-info/METADATA, found {candidates}")
            metadata = archive.read(candidates[0])
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InvalidInputError(f"{filename} is not a readable wheel (zip): {exc}") from exc
    headers = BytesHeaderParser().parsebytes(metadata)
    try:
        meta_version = str(Version(headers.get("Version", "")))
    except InvalidVersion as exc:
        raise InvalidInputError(f"{filename}: METADATA Version {headers.get('Version')!r} is invalid") from exc
    if canonicalize_name(headers.get("Name", "")) != project or meta_version != version:
        raise InvalidInputError(
            f"{filename}: METADATA says {headers.get('Name')!r} {headers.get('Version')!r},"
            f" the filename says {project} {version}"
        )
    return metadata


def requires_python(metadata: bytes) -> str | None:
    value = BytesHeaderParser().parsebytes(metadata).get("Requires-Python")
    return str(value).strip() if value else None


def describe_wheel(filename: str, data: bytes, upload_time: float) -> tuple[Distribution, bytes]:
    """The index record of a wheel held in memory, and its METADATA bytes."""
    metadata = core_metadata(filename, data)
    dist = make_distribution(
        filename,
        sha256_bytes(data),
        len(data),
        upload_time,
        requires_python=requires_python(metadata),
        metadata_sha256=sha256_bytes(metadata),
    )
    return dist, metadata


def read_wheel(path: Path, upload_time: float | None = None) -> tuple[Distribution, bytes]:
    """Like :func:`describe_wheel` for a file; the upload time defaults to its mtime (stable across runs)."""
    path = Path(path)
    data = path.read_bytes()
    return describe_wheel(path.name, data, path.stat().st_mtime if upload_time is None else upload_time)


def _importable(names: set[str], package: str) -> str | None:
    """``package`` if it is a regular package or module; for a namespace portion, its first regular subpackage."""
    if f"{package}/__init__.py" in names or f"{package}.py" in names or any(
            n.startswith(package + ".") and n.endswith((".so", ".pyd")) and "/" not in n for n in names):
        return package.replace("/", ".")
    children = sorted({n[len(package) + 1:].split("/")[0] for n in names if n.startswith(package + "/")})
    for child in children:
        found = _importable(names, f"{package}/{child}") if "." not in child else None
        if found:
            return found
    return None


def import_names(filename: str, data: bytes) -> tuple[str, ...]:
    """The modules a wheel makes importable, read from the wheel itself, never guessed from its name.

    ``top_level.txt`` when the wheel has one, else the top-level entries of
    ``RECORD``; a namespace portion (``kiln/`` without ``__init__.py``) names
    its first regular package (``kiln.runtime``), so importing it proves the
    wheel's files load.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = set(archive.namelist())
            top_level = [n for n in members if n.count("/") == 1 and n.endswith(".dist-info/top_level.txt")]
            declared = archive.read(top_level[0]).decode().split() if top_level else []
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InvalidInputError(f"{filename} is not a readable wheel (zip): {exc}") from exc
    files = {n for n in members if not n.split("/")[0].endswith((".dist-info", ".data"))}
    tops = declared or sorted({n.split("/")[0].split(".")[0] if "/" not in n else n.split("/")[0] for n in files})
    found = (_importable(files, top.replace(".", "/")) for top in tops if top and top.isidentifier())
    return tuple(sorted({name for name in found if name}))
