"""A variant's wheel under its public version: the bytes PyPI gets (``1.2.0+cu130`` → ``1.2.0``).

PyPI refuses local versions, so one designated variant goes there under the
public version, as PyTorch's ``prep_binary_for_pypi`` does. Nothing else
changes: every member keeps its bytes, zip date and mode; only ``METADATA``'s
``Version``, the ``.dist-info``/``.data`` directory names, the version in
Kiln's SBOM (PEP 770) and ``RECORD`` (recomputed by ``wheel.WheelFile``) do.
The source wheel's ``RECORD`` is checked first (:func:`kiln.core.wheels.check_record`):
promoting bytes no one can vouch for is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from packaging.tags import Tag
from packaging.utils import BuildTag, InvalidWheelFilename, NormalizedName, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from wheel.wheelfile import WheelFile

from kiln.core.errors import InvalidInputError
from kiln.core.wheels import check_record, open_wheel, read_member, renamed_member
from kiln.release.index.variants import wheel_variant_label

SBOM_SUFFIX = ".cdx.json"  # CycloneDX documents under <dist-info>/sboms/ (PEP 770)
MAX_MEMBER_BYTES = 1 << 30  # PyPI's largest grant: no member of a wheel it takes is larger


class _DatedWheelFile(WheelFile):  # type: ignore[misc]  # the wheel package ships no type hints
    """A ``WheelFile`` that dates the RECORD it writes (by path alone) with the source RECORD's time, not the
    clock: the same wheel re-versioned twice gives the same bytes, so a re-run finds them on the index."""

    def __init__(self, path: Path, date_time: tuple[int, int, int, int, int, int]) -> None:
        super().__init__(path, "w")
        self.date_time = date_time

    # Any: as zipfile.ZipFile.writestr takes them (str or ZipInfo; bytes or str)
    def writestr(self, zinfo_or_arcname: Any, data: Any, compress_type: int | None = None) -> None:
        if isinstance(zinfo_or_arcname, str):
            info = zipfile.ZipInfo(zinfo_or_arcname, self.date_time)
            info.external_attr, info.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
            zinfo_or_arcname = info
        super().writestr(zinfo_or_arcname, data, compress_type)


def public_filename(filename: str) -> str:
    """``filename`` with its version's local label dropped; the same name when it has none."""
    version = _parsed(filename)[1]
    head, _, rest = filename.split("-", 2)
    return f"{head}-{version.public}-{rest}"


def _parsed(filename: str) -> tuple[NormalizedName, Version, BuildTag, frozenset[Tag]]:
    """The PEP 427 parts of a wheel's name; a PEP 825 variant wheel's is read without its label."""
    label = wheel_variant_label(filename)
    plain = filename.removesuffix(f"-{label}.whl") + ".whl" if label is not None else filename
    try:
        return parse_wheel_filename(plain)
    except (InvalidWheelFilename, InvalidVersion) as exc:
        raise InvalidInputError(f"{filename!r} is not a PEP 427 wheel name: {exc}") from exc


def _dist_info(archive: zipfile.ZipFile, wheel: str) -> str:
    """``<name>-<version>`` of the wheel's one top-level ``.dist-info`` directory."""
    found = {n.split("/")[0][: -len(".dist-info")] for n in archive.namelist()
             if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info") and n.endswith("/METADATA")}
    if len(found) != 1:
        raise InvalidInputError(f"{wheel}: expected one top-level .dist-info directory with METADATA,"
                                f" found {sorted(found)}")
    return found.pop()


def _metadata(data: bytes, version: str) -> bytes:
    """``METADATA`` with its ``Version`` line replaced, every other byte kept (no re-serialising)."""
    lines = data.split(b"\n")
    header_end = lines.index(b"") if b"" in lines else len(lines)
    hits = [i for i in range(header_end) if lines[i].lower().startswith(b"version:")]
    if len(hits) != 1:
        raise InvalidInputError(f"METADATA has {len(hits)} Version lines in its headers, not one")
    lines[hits[0]] = b"Version: " + version.encode()
    return b"\n".join(lines)


def _subject_ref(value: str, distribution: str, old: str, new: str) -> str:
    """A ``pkg:pypi/<distribution>@<old>`` reference (bom-ref or purl, ``+`` spelled or encoded) naming ``new``."""
    head, sep, version = value.partition("@")
    if not sep or not head.startswith("pkg:pypi/") or canonicalize_name(head[len("pkg:pypi/"):]) != distribution:
        return value
    return f"{head}@{new}" if unquote(version) == old else value


def _sbom(data: bytes, distribution: str, old: str, new: str) -> bytes:
    """Kiln's SBOM naming ``new``: the subject's version, bom-ref and purl, and the references to them."""
    # Any: any JSON value, walked
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if value == old:
            return new
        return _subject_ref(value, distribution, old, new) if isinstance(value, str) else value
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise InvalidInputError(f"the SBOM is not JSON: {exc}") from exc
    return (json.dumps(walk(document), indent=2) + "\n").encode()


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, wheel: str, names: tuple[str, str, str],
            distribution: str) -> tuple[zipfile.ZipInfo, bytes] | None:
    """(new zip entry, bytes) of one member under the public version; None for RECORD (rewritten)."""
    old_dir, new_dir, new_version = names
    if info.filename.startswith(f"{old_dir}.dist-info/RECORD"):
        return None
    data = read_member(archive, info.filename, wheel, MAX_MEMBER_BYTES)
    if info.filename == f"{old_dir}.dist-info/METADATA":
        data = _metadata(data, new_version)
    elif info.filename.startswith(f"{old_dir}.dist-info/sboms/") and info.filename.endswith(SBOM_SUFFIX):
        data = _sbom(data, distribution, old_dir.split("-", 1)[1], new_version)
    entry = zipfile.ZipInfo(renamed_member(info.filename, old_dir, new_dir), info.date_time)
    entry.external_attr, entry.compress_type = info.external_attr, info.compress_type
    return entry, data


def public_wheel(source: Path, out_dir: Path) -> Path:
    """Write ``source`` under its public version into ``out_dir``; returns the new wheel's path.

    A wheel whose version has no local label is returned as it is (already public).
    """
    version = _parsed(source.name)[1]
    if version.local is None:
        return source
    return reversioned_wheel(source, out_dir, version.public)


def reversioned_wheel(source: Path, out_dir: Path, new_version: str) -> Path:
    """Write ``source`` under ``new_version`` into ``out_dir`` (every binary kept byte for byte; METADATA,
    the .dist-info/.data names, the SBOM's version and RECORD follow; a variant wheel keeps its label and its
    ``variant.json``); returns the new wheel's path."""
    filename = source.name
    name = _parsed(filename)[0]
    try:
        wanted = str(Version(new_version))
    except InvalidVersion as exc:
        raise InvalidInputError(f"version {new_version!r} for {filename} is not a PEP 440 version") from exc
    check_record(filename, source)
    head, _, rest = filename.split("-", 2)
    target = f"{head}-{wanted}-{rest}"
    with open_wheel(filename, source) as archive:
        old_dir = _dist_info(archive, filename)
        dated = archive.getinfo(f"{old_dir}.dist-info/RECORD").date_time
    names = (old_dir, f"{old_dir.split('-', 1)[0]}-{wanted}", wanted)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".reversion-", dir=out_dir))
    try:
        with open_wheel(filename, source) as archive, _DatedWheelFile(staging / target, dated) as written:
            for info in archive.infolist():
                member = None if info.is_dir() else _member(archive, info, filename, names, str(name))
                if member is not None:
                    written.writestr(*member)
        os.replace(staging / target, out_dir / target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir / target
