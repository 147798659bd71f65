"""The distribution record an index lists, validated once at the edge.

A :class:`Distribution` is one file of one project: its PEP 427 wheel (or
sdist) filename, SHA-256, size, upload time, and what PEP 503/592/658/700 need
(``Requires-Python``, the metadata sidecar's hash, a yank reason). Every field
is checked when the record is made — names go through ``packaging.utils``,
never a regex — so the index generator can trust what it renders.

Upload times are whole Unix seconds: index pages round-trip them through an
ISO 8601 string, and whole seconds make that round trip exact (a re-run must
produce the same bytes).
"""

from __future__ import annotations

import math
import re
import string
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, NamedTuple

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError

_HEX = frozenset(string.hexdigits.lower())
MAX_SIZE = 1 << 63  # past what a 64-bit file offset can reach: a size above it is a broken list
MAX_UPLOAD_TIME = 253402300799  # 9999-12-31T23:59:59Z, the last time PEP 700's format can write
UPLOAD_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # PEP 700
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: The end of a PEP 825 index-level variants file's name: ``{name}-{version}-variants.json``.
VARIANTS_JSON_SUFFIX = "-variants.json"
_VARIANT_LABEL = re.compile(r"[0-9a-z_.]+")  # PEP 825's label characters


class Distribution(NamedTuple):
    """One file of one project, as an index lists it. Build with :func:`make_distribution`.

    A NamedTuple rather than a frozen dataclass: as immutable and typed, and
    built several times faster — ``kiln index`` builds one per listed file.
    """

    filename: str
    project: str  # PEP 503-normalised name
    version: str  # normalised PEP 440 version, local part included
    sha256: str
    size: int
    upload_time: int  # Unix seconds
    requires_python: str | None = None
    metadata_sha256: str | None = None  # PEP 658 sidecar ``<filename>.metadata``
    yanked: str | None = None  # PEP 592: None = not yanked, "" = yanked without reason

    @property
    def upload_time_iso(self) -> str:
        # Whole seconds, so the fraction is always zero. Unix time has no leap seconds (every
        # minute is 60 s), so one strftime per minute serves all files uploaded in it: a
        # publish stamps all its files with one time.
        minute, second = divmod(self.upload_time, 60)
        return _iso_minute(minute) + _ISO_SECONDS[second]


_ISO_SECONDS = tuple(f"{second:02d}.000000Z" for second in range(60))


@lru_cache(maxsize=1 << 16)
def _iso_minute(minute: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:", time.gmtime(minute * 60))


def check_filename(filename: str) -> str:
    """Refuse anything that is not a bare file name (no path, no control characters)."""
    if not isinstance(filename, str) or not filename:
        raise InvalidInputError(f"distribution filename {filename!r} is empty")
    if _CONTROL.search(filename):
        raise InvalidInputError(f"distribution filename {filename!r} contains a control character")
    if "/" in filename or "\\" in filename or filename.startswith(".") or ":" in filename:
        raise InvalidInputError(
            f"distribution filename {filename!r} must be a bare file name, not a path"
            " (no '/', '\\', ':' or leading '.')"
        )
    return filename


@lru_cache(maxsize=1 << 14)
def _wheel_name(name_part: str) -> str:
    return canonicalize_name(parse_wheel_filename(f"{name_part}-0-py3-none-any.whl")[0])


@lru_cache(maxsize=1 << 14)
def _wheel_version(rest: str) -> str:
    return str(parse_wheel_filename(f"x-{rest}")[1])


def _parse_wheel(filename: str) -> tuple[str, str]:
    """``parse_wheel_filename`` split at the first '-' into two cached halves.

    A wheel's name part holds no '-', so packaging validates the name and the
    version/build/tags independently; an index repeats both halves thousands
    of times (one version set across projects, one name across versions).
    On any error the whole filename is parsed again so the message names it.
    A PEP 825 variant wheel (a variant label after the platform tag, which
    packaging does not parse yet) is the wheel without its label.
    """
    name_part, _, rest = filename.partition("-")
    try:
        return _wheel_name(name_part), _wheel_version(rest)
    except (InvalidWheelFilename, InvalidVersion):
        unlabelled = _without_variant_label(filename)
        if unlabelled is not None:
            return _parse_wheel(unlabelled)
        name, version, _build, _tags = parse_wheel_filename(filename)
        return name, str(version)


def _without_variant_label(filename: str) -> str | None:
    """``name-version[-build]-tags-label.whl`` without its PEP 825 variant label, else None."""
    parts = filename.removesuffix(".whl").split("-")
    build = len(parts) > 2 and parts[2][:1].isdigit()
    if len(parts) != (7 if build else 6) or not _VARIANT_LABEL.fullmatch(parts[-1]):
        return None
    return "-".join(parts[:-1]) + ".whl"


def _parse_variants_json(filename: str) -> tuple[str, str]:
    """(project, version) of a PEP 825 ``{name}-{version}-variants.json`` (both as a wheel's file name spells them)."""
    name_part, sep, version = filename.removesuffix(VARIANTS_JSON_SUFFIX).partition("-")
    if not sep or "-" in version:
        raise InvalidInputError(f"{filename!r} is not a variants file name {{name}}-{{version}}{VARIANTS_JSON_SUFFIX}")
    try:
        return _wheel_name(name_part), str(Version(version))
    except (InvalidWheelFilename, InvalidVersion) as exc:
        raise InvalidInputError(f"{filename!r} is not a valid variants file name (PEP 825): {exc}") from exc


def parse_filename(filename: str) -> tuple[str, str]:
    """(normalised project name, normalised version) of a PEP 427 wheel (a PEP 825 variant wheel too), an sdist
    filename, or a PEP 825 ``{name}-{version}-variants.json``."""
    check_filename(filename)
    try:
        if filename.endswith(".whl"):
            return _parse_wheel(filename)
        if filename.endswith(VARIANTS_JSON_SUFFIX):
            return _parse_variants_json(filename)
        if filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
        else:
            raise InvalidInputError(f"{filename!r} is neither a wheel (.whl), an sdist (.tar.gz, .zip) nor a variants"
                                    f" file (*{VARIANTS_JSON_SUFFIX})")
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion) as exc:
        raise InvalidInputError(f"{filename!r} is not a valid distribution filename (PEP 427 / sdist): {exc}") from exc
    return canonicalize_name(name), str(version)


# Any: a field of an untrusted JSON line, checked here
def check_sha256(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise InvalidInputError(f"{what}: {value!r} is not a lowercase hex SHA-256 (64 characters)")
    return value


@lru_cache(maxsize=4096)
def check_requires_python(value: str) -> str:
    """Validate a ``Requires-Python`` specifier (cached: a whole index shares a handful)."""
    try:
        SpecifierSet(value)
    except InvalidSpecifier as exc:
        raise InvalidInputError(f"requires_python {value!r} is not a valid PEP 440 specifier set: {exc}") from exc
    if _CONTROL.search(value):
        raise InvalidInputError(f"requires_python {value!r} contains a control character")
    return value


# Any: a field of an untrusted JSON line, checked here
def _check_int(value: Any, what: str, most: int) -> int:
    """A whole non-negative number up to ``most``: NaN, infinities and absurd values are input errors."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise InvalidInputError(f"{what}: {value!r} must be a non-negative number")
    if not math.isfinite(value) or value > most:
        raise InvalidInputError(f"{what}: {value!r} is not a plausible value (at most {most})")
    return int(value)


def make_distribution(
    filename: str,
    sha256: str,
    size: int,
    upload_time: float,
    requires_python: str | None = None,
    metadata_sha256: str | None = None,
    yanked: str | None = None,
) -> Distribution:
    """Validate every field and build the record; raise :class:`InvalidInputError` naming the bad one."""
    project, version = parse_filename(filename)
    where = f"distribution {filename!r}"
    if yanked is not None and not isinstance(yanked, str):
        raise InvalidInputError(f"{where}: yanked must be a reason string, got {yanked!r}")
    if yanked and _CONTROL.search(yanked):
        raise InvalidInputError(f"{where}: yank reason {yanked!r} contains a control character")
    return Distribution(
        filename=filename,
        project=project,
        version=version,
        sha256=check_sha256(sha256, f"{where} sha256"),
        size=_check_int(size, f"{where} size", MAX_SIZE),
        upload_time=_check_int(upload_time, f"{where} upload_time", MAX_UPLOAD_TIME),
        requires_python=None if not requires_python else check_requires_python(requires_python),
        metadata_sha256=None if metadata_sha256 is None else check_sha256(metadata_sha256, f"{where} metadata_sha256"),
        yanked=yanked,
    )


_RECORD_KEYS = frozenset({"filename", "sha256", "size", "upload_time", "requires_python", "metadata_sha256", "yanked"})
_REQUIRED_KEYS = frozenset({"filename", "sha256", "size", "upload_time"})
# The two halves of a wheel filename (split at the first '-') made of only these
# characters pass check_filename: no control character, '/', '\\', ':' or leading '.'.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*")
_PLAIN_REST = re.compile(r"[A-Za-z0-9_.!+-]*\.whl")
_SHA256 = re.compile(r"[0-9a-f]{64}")


# Any: one parsed JSON line of a --from-list file, checked here
def from_record(record: Any, where: str = "record") -> Distribution:
    """A distribution from one ``--from-list`` JSON object (see ``kiln index --from-list``)."""
    if not isinstance(record, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - _RECORD_KEYS
    missing = {"filename", "sha256", "size", "upload_time"} - set(record)
    if unknown or missing:
        raise InvalidInputError(
            f"{where}: unknown keys {sorted(unknown)} / missing keys {sorted(missing)}; allowed: {sorted(_RECORD_KEYS)}"
        )
    try:
        return make_distribution(**record)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from exc


def from_records(records: Iterable[Any], where: Callable[[int], str]) -> list[Distribution]:
    """:func:`from_record` for many records; ``where(i)`` names record ``i`` in an error.

    The usual record (a wheel, whole-number size and time, optional fields
    absent or plain) is checked inline with the caches of a few distinct
    names, versions and specifiers; anything else goes through
    :func:`from_record`, which gives the same result or names the problem.
    """
    out: list[Distribution] = []
    append = out.append
    for number, record in enumerate(records):
        dist = _plain_record(record)
        append(dist if dist is not None else from_record(record, where(number)))
    return out


# Any: one parsed JSON line of a --from-list file, checked here
def _plain_record(record: Any) -> Distribution | None:
    """The distribution of a record that needs no more than the usual checks, else None."""
    if type(record) is not dict or not _REQUIRED_KEYS <= record.keys() <= _RECORD_KEYS:
        return None
    filename, sha256, size, upload_time = record["filename"], record["sha256"], record["size"], record["upload_time"]
    if (type(filename) is not str or type(sha256) is not str or type(size) is not int or type(upload_time) is not int
            or not 0 <= size <= MAX_SIZE or not 0 <= upload_time <= MAX_UPLOAD_TIME or not _SHA256.fullmatch(sha256)):
        return None
    name_part, _, rest = filename.partition("-")
    project, version = _plain_wheel_name(name_part), _plain_wheel_rest(rest)
    if project is None or version is None:
        return None
    requires_python, metadata = record.get("requires_python"), record.get("metadata_sha256")
    yanked = record.get("yanked")
    if requires_python and type(requires_python) is not str or metadata is not None and (
            type(metadata) is not str or not _SHA256.fullmatch(metadata)) or yanked is not None and (
            type(yanked) is not str or _CONTROL.search(yanked)):
        return None
    try:
        requires_python = check_requires_python(requires_python) if requires_python else None
    except InvalidInputError:
        return None  # from_record raises it naming the record
    return Distribution(filename, project, version, sha256, size, upload_time, requires_python, metadata, yanked)


@lru_cache(maxsize=1 << 14)
def _plain_wheel_name(part: str) -> str | None:
    """The normalised project name of a plain wheel name half, else None."""
    try:
        return _wheel_name(part) if _PLAIN_NAME.fullmatch(part) else None
    except InvalidWheelFilename:
        return None


@lru_cache(maxsize=1 << 14)
def _plain_wheel_rest(rest: str) -> str | None:
    """The normalised version of a plain version/build/tags half, else None."""
    try:
        return _wheel_version(rest) if _PLAIN_REST.fullmatch(rest) else None
    except (InvalidWheelFilename, InvalidVersion):
        return None


def to_record(dist: Distribution) -> dict[str, Any]:
    """The inverse of :func:`from_record` (optional keys only when set)."""
    record: dict[str, Any] = {
        "filename": dist.filename, "sha256": dist.sha256, "size": dist.size, "upload_time": dist.upload_time,
    }
    for key in ("requires_python", "metadata_sha256", "yanked"):
        if getattr(dist, key) is not None:
            record[key] = getattr(dist, key)
    return record


def parse_upload_time(value: str, where: str) -> int:
    try:
        parsed = datetime.strptime(value, UPLOAD_TIME_FORMAT).replace(tzinfo=UTC)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{where}: upload-time {value!r} is not {UPLOAD_TIME_FORMAT}") from exc
    return int(parsed.timestamp())
