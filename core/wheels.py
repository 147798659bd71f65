"""Read a wheel for an index: its hash, size, core metadata (the PEP 658 sidecar) and RECORD.

A wheel is untrusted input: a small file may inflate to gigabytes. Every
member Kiln reads whole (METADATA, RECORD, WHEEL, ``top_level.txt``, Kiln's
own manifests) goes through :func:`read_member`, which checks the size the zip
header states against :data:`MEMBER_LIMITS` before inflating anything and
caps the read itself, so a header that lies cannot inflate past the limit.
The wheel file itself is hashed streaming (:func:`~kiln.core.fsutil.sha256_file`),
never read whole; members checked against RECORD are hashed streaming too.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from email.parser import BytesHeaderParser
from pathlib import Path, PurePosixPath

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.core.dists import Distribution, make_distribution, parse_filename
from kiln.core.errors import InvalidInputError, MemberTooLargeError, RecordMismatchError
from kiln.core.fsutil import sha256_bytes, sha256_file

MIB = 1 << 20
# The most Kiln inflates of one member it reads whole, by file name. METADATA with a long
# description is tens of KB; a RECORD of 20,000 files (a torch wheel) about 3 MB.
MEMBER_LIMITS: Mapping[str, int] = {
    "METADATA": 16 * MIB,
    "RECORD": 64 * MIB,
    "WHEEL": 1 * MIB,
    "top_level.txt": 1 * MIB,
    "kiln_build.json": 4 * MIB,
    "manifest.json": 64 * MIB,
}
DEFAULT_MEMBER_LIMIT = 1 * MIB
# What RECORD checking inflates in all (streaming, so time, not memory): an overlapping-entries
# zip bomb declares terabytes in a few megabytes.
MAX_TOTAL_INFLATED = 16 * 1024 * MIB
_SIGNATURES = ("RECORD", "RECORD.jws", "RECORD.p7s")
_CHUNK = 1 << 20

WheelSource = bytes | Path


def member_limit(name: str) -> int:
    """The most Kiln reads of member ``name`` (by its file name)."""
    return MEMBER_LIMITS.get(PurePosixPath(name).name, DEFAULT_MEMBER_LIMIT)


@contextmanager
def open_wheel(wheel: str, source: WheelSource) -> Iterator[zipfile.ZipFile]:
    """The zip archive of a wheel held in memory or on disk; InvalidInputError naming ``wheel`` if unreadable."""
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as archive:
            yield archive
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as exc:
        raise InvalidInputError(f"{wheel} is not a readable wheel (zip): {exc}") from exc


def read_member(archive: zipfile.ZipFile, name: str, wheel: str, limit: int | None = None) -> bytes:
    """The bytes of member ``name``, at most ``limit`` (default :func:`member_limit`) of them.

    MemberTooLargeError naming the wheel and the member when the zip header
    states more, or when inflating gives more than the header stated.
    """
    cap = member_limit(name) if limit is None else limit
    info = _within_declared(archive, name, wheel, cap)
    try:
        with archive.open(info) as handle:
            data = handle.read(cap + 1)  # bounded: inflation stops here, whatever the header claimed
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise _corrupt(wheel, name, exc) from exc
    if len(data) > cap:
        raise _inflated_past(wheel, name, cap, info)
    return data


def copy_member(archive: zipfile.ZipFile, name: str, wheel: str, dest: Path, limit: int) -> int:
    """Inflate member ``name`` into the file ``dest`` streaming, at most ``limit`` bytes; how many were written.

    The checks of :func:`read_member` for a member too large to hold in memory (a shared library)."""
    info = _within_declared(archive, name, wheel, limit)
    written = 0
    try:
        with archive.open(info) as handle, open(dest, "wb") as out:
            for block in iter(lambda: handle.read(_CHUNK), b""):
                written += len(block)
                if written > limit:
                    raise _inflated_past(wheel, name, limit, info)
                out.write(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise _corrupt(wheel, name, exc) from exc
    return written

def unpack_member(archive: zipfile.ZipFile, name: str, stage: Path, relative: str, wheel: str) -> Path:
    """Member ``name`` of ``wheel`` written at ``stage / relative``, streamed (:func:`copy_member`, its size
    as stated), executable where the archive says so; a member that would land outside ``stage`` is refused."""
    target = stage / relative
    if not target.resolve().is_relative_to(stage.resolve()):
        raise InvalidInputError(f"{wheel} has a member outside its folder: {name!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    info = archive.getinfo(name)
    copy_member(archive, name, wheel, target, info.file_size)
    if (info.external_attr >> 16) & 0o100:
        os.chmod(target, 0o755)
    return target



def _within_declared(archive: zipfile.ZipFile, name: str, wheel: str, cap: int) -> zipfile.ZipInfo:
    info = archive.getinfo(name)
    if info.file_size > cap:
        raise MemberTooLargeError(
            f"{wheel}: member {name} inflates to {info.file_size} bytes (its zip header says so), over Kiln's limit"
            f" of {cap} bytes for it; not read. A wheel like this is broken or hostile: rebuild it")
    return info


def _inflated_past(wheel: str, name: str, cap: int, info: zipfile.ZipInfo) -> MemberTooLargeError:
    return MemberTooLargeError(
        f"{wheel}: member {name} inflates past Kiln's limit of {cap} bytes although its zip header says"
        f" {info.file_size}; reading stopped there. The wheel is broken or hostile: rebuild it")


def _corrupt(wheel: str, name: str, exc: Exception) -> InvalidInputError:
    return InvalidInputError(f"{wheel}: member {name} is corrupt or not what its zip header says: {exc}")


def _dist_info_member(archive: zipfile.ZipFile, wheel: str, member: str) -> str:
    candidates = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(f".dist-info/{member}")]
    if len(candidates) != 1:
        raise InvalidInputError(f"{wheel}: expected one top-level *.dist-info/{member}, found {candidates}")
    return candidates[0]


def core_metadata(filename: str, source: WheelSource) -> bytes:
    """The bytes of ``<name>-<version>.dist-info/METADATA`` inside a wheel (bytes or a path).

    The metadata must name the same project and version as the filename: a
    sidecar that disagrees with its wheel would make resolvers pick wrong.
    """
    project, version = parse_filename(filename)
    with open_wheel(filename, source) as archive:
        metadata = read_member(archive, _dist_info_member(archive, filename, "METADATA"), filename)
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


def read_wheel(path: Path, upload_time: float | None = None) -> tuple[Distribution, bytes]:
    """The index record of a wheel file, hashed streaming, and its METADATA bytes (read under their limit).

    The upload time defaults to the file's mtime. Nothing reads a wheel whole: publishing sends the file
    itself (:meth:`~kiln.core.objects.Store.put_immutable_file`).
    """
    path = Path(path)
    stat = path.stat()
    size, mtime = stat.st_size, stat.st_mtime
    metadata = core_metadata(path.name, path)
    dist = make_distribution(
        path.name,
        sha256_file(path),
        size,
        mtime if upload_time is None else upload_time,
        requires_python=requires_python(metadata),
        metadata_sha256=sha256_bytes(metadata),
    )
    return dist, metadata


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


def import_names(filename: str, source: WheelSource) -> tuple[str, ...]:
    """The modules a wheel makes importable, read from the wheel itself, never guessed from its name.

    ``top_level.txt`` when the wheel has one, else the top-level entries of
    ``RECORD``; a namespace portion (``kiln/`` without ``__init__.py``) names
    its first regular package (``kiln.runtime``), so importing it proves the
    wheel's files load.
    """
    with open_wheel(filename, source) as archive:
        members = set(archive.namelist())
        top_level = [n for n in members if n.count("/") == 1 and n.endswith(".dist-info/top_level.txt")]
        declared = read_member(archive, top_level[0], filename).decode("utf-8", "replace").split() if top_level else []
    files = {n for n in members if not n.split("/")[0].endswith((".dist-info", ".data"))}
    tops = declared or sorted({n.split("/")[0].split(".")[0] if "/" not in n else n.split("/")[0] for n in files})
    found = (_importable(files, top.replace(".", "/")) for top in tops if top and top.isidentifier())
    return tuple(sorted({name for name in found if name}))


def _record_rows(archive: zipfile.ZipFile, wheel: str, name: str) -> dict[str, tuple[str, str]]:
    """{path: (hash, size)} of RECORD; InvalidInputError for a row that is not path,hash,size."""
    text = read_member(archive, name, wheel).decode("utf-8", "replace")
    rows: dict[str, tuple[str, str]] = {}
    for number, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row:
            continue
        if len(row) != 3:
            raise RecordMismatchError(f"{wheel}: {name} line {number} is not 'path,hash,size': {row!r}")
        rows[row[0]] = (row[1], row[2])
    return rows


def _member_digest(archive: zipfile.ZipFile, info: zipfile.ZipInfo, algorithm: str) -> tuple[str, int]:
    """(urlsafe-base64 digest without padding, size) of one member, inflated streaming."""
    digest, size = hashlib.new(algorithm), 0
    with archive.open(info) as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
            size += len(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode(), size


def _check_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, wheel: str, expected: tuple[str, str]) -> str | None:
    """What is wrong with one member against its RECORD row (hash and size), or None."""
    hash_field, size_field = expected
    algorithm, _, value = hash_field.partition("=")
    if algorithm not in ("sha256", "sha384", "sha512") or not value:
        return f"{wheel}: RECORD gives {info.filename} no sha256 (or stronger) hash: {hash_field!r}"
    try:
        actual, size = _member_digest(archive, info, algorithm)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        return f"{wheel}: member {info.filename} is corrupt: {exc}"
    if actual != value or size_field not in ("", str(size)):
        return (f"{wheel}: RECORD says {info.filename} has {hash_field} size {size_field or '?'},"
                f" the member has {algorithm}={actual} size {size}")
    return None


def record_problems(wheel: str, source: WheelSource, max_total: int = MAX_TOTAL_INFLATED) -> list[str]:
    """What a wheel's RECORD gets wrong about its members: every member's hash and size, members it does
    not list, entries the wheel does not hold. Empty when RECORD is true.

    InvalidInputError (or its MemberTooLargeError) when the wheel or its RECORD cannot be read at all, or
    its members declare more than ``max_total`` bytes in all.
    """
    with open_wheel(wheel, source) as archive:
        record = _dist_info_member(archive, wheel, "RECORD")
        rows = _record_rows(archive, wheel, record)
        infos = [i for i in archive.infolist() if not i.is_dir()]
        declared = sum(i.file_size for i in infos)
        if declared > max_total:
            raise MemberTooLargeError(f"{wheel}: its members inflate to {declared} bytes in all (zip headers), over"
                                      f" the limit of {max_total} for checking RECORD; not checked")
        problems, seen = [], set[str]()
        signatures = {f"{record.rpartition('/')[0]}/{name}" for name in _SIGNATURES}
        for info in infos:
            if info.filename in seen:
                problems.append(f"{wheel}: member {info.filename} appears twice in the zip")
            seen.add(info.filename)
            if info.filename in signatures:
                continue
            if info.filename not in rows:
                problems.append(f"{wheel}: member {info.filename} is not listed in RECORD")
                continue
            problem = _check_member(archive, info, wheel, rows[info.filename])
            if problem:
                problems.append(problem)
    problems += [f"{wheel}: RECORD lists {path}, which the wheel does not hold" for path in sorted(set(rows) - seen)]
    return problems


def check_record(wheel: str, source: WheelSource) -> None:
    """RecordMismatchError naming what :func:`record_problems` finds, if anything."""
    problems = record_problems(wheel, source)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise RecordMismatchError(f"{wheel}: its RECORD does not describe its members: {listed}")


def renamed_member(arcname: str, old: str, new: str) -> str:
    """``arcname`` with the wheel's ``{old}.dist-info/`` or ``{old}.data/`` folder renamed to ``{new}``'s
    (a wheel re-versioned or given another name); every other member keeps its name."""
    head, sep, rest = arcname.partition("/")
    for suffix in (".dist-info", ".data"):
        if sep and head == old + suffix:
            return f"{new}{suffix}/{rest}"
    return arcname
