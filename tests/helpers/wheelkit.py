"""Tiny, valid, installable wheels for release tests (no build backend needed)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import canonicalize_name


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    *,
    module: str | None = None,
    requires_python: str | None = ">=3.8",
    tag: str = "py3-none-any",
    payload: str = "",
    requires: Sequence[str] = (),
    body: str = "",
    label: str | None = None,
    variant_json: bytes | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``<name>-<version>-<tag>.whl`` with an importable module and return its path.

    ``payload`` goes into the module so two wheels of one name can differ in bytes;
    ``requires`` become ``Requires-Dist`` lines and ``body`` is appended to the module
    (e.g. an import of a dependency, so importing proves the dependency was installed).
    ``label`` makes it a PEP 825 variant wheel (``…-<tag>-<label>.whl``) holding ``variant_json``.
    ``files``: more members by path (e.g. a ``.pth`` file, which runs at every interpreter start).
    """
    dist = canonicalize_name(name).replace("-", "_")
    module = module or dist
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires_python:
        metadata += f"Requires-Python: {requires_python}\n"
    metadata += "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
    members = {
        f"{module}/__init__.py": f"__version__ = {version!r}\nPAYLOAD = {payload!r}\n{body}".encode(),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: kiln-tests\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
    }
    if variant_json is not None:
        members[f"{info}/variant.json"] = variant_json
    members.update(files or {})
    record = [_record_line(p, d) for p, d in members.items()] + [f"{info}/RECORD,,"]
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = Path(directory) / f"{dist}-{version}-{tag}{'-' + label if label else ''}.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            # fixed timestamps: the same call gives the same bytes
            archive.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return path


def claim_member_size(path: Path, member: str, claimed: int) -> None:
    """Make both zip headers (local and central) of ``member`` claim ``claimed`` uncompressed bytes: a lying
    header, as a hostile wheel would have it."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    for signature, size_offset, name_offset in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        start = 0
        while (start := data.find(signature, start)) >= 0:
            if data[start + name_offset:start + name_offset + len(name)] == name:
                data[start + size_offset:start + size_offset + 4] = claimed.to_bytes(4, "little")
            start += 4
    path.write_bytes(bytes(data))


def rewrite_members(path: Path, changes: dict[str, bytes]) -> None:
    """Replace members' bytes, keeping every other member (RECORD included) as it was: a wheel whose RECORD lies."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    members.update(changes)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), data)
