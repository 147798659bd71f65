"""The plan of an upload to a PyPI-compatible index, judged by PyPI's rules before anything moves.

Pure: the files to send (:class:`Candidate`), what the index already holds
(:class:`IndexFile`), the limits (:class:`Limits`) and the clock go in; an
:class:`UploadPlan` comes out, saying for each file whether it is sent,
skipped (the index holds the same bytes under its name) or refused, and why.
PyPI's rules, each refused here rather than by the server halfway through:

* a local version (``+cu130``) and a plain ``linux_*`` platform tag are refused
  (PyPI takes neither: only a designated variant goes, under the public version,
  with a manylinux tag);
* a file over the project's size limit (100 MiB unless PyPI granted more, never
  over 1 GiB) is refused, naming its ten largest members;
* the project's size after the upload must stay within its quota (10 GiB by default);
* a release's files must all go up within 14 days of its first file;
* a name the index already holds is compared by sha256: the same bytes are
  skipped (nothing sent), other bytes are refused by name (published files are immutable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from kiln.core.errors import IMMUTABLE_HINT, InvalidInputError

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_FILE_LIMIT = 100 * MIB
MAX_FILE_LIMIT = 1 * GIB  # no grant PyPI gives is larger
DEFAULT_QUOTA = 10 * GIB
RELEASE_WINDOW = timedelta(days=14)
LARGEST_LISTED = 10

Action = Literal["upload", "skip", "refuse"]


@dataclass(frozen=True)
class Member:
    name: str
    size: int


@dataclass(frozen=True)
class Candidate:
    """A file the release would send: its name, hash, size and (a wheel's) largest members, largest first."""

    filename: str
    sha256: str
    size: int
    largest: tuple[Member, ...] = ()


@dataclass(frozen=True)
class IndexFile:
    """A file the index already holds; its size and upload time as far as the index says them."""

    filename: str
    sha256: str
    size: int | None = None
    upload_time: datetime | None = None


@dataclass(frozen=True)
class Limits:
    file_bytes: int = DEFAULT_FILE_LIMIT
    quota_bytes: int = DEFAULT_QUOTA

    def __post_init__(self) -> None:
        if not 0 < self.file_bytes <= MAX_FILE_LIMIT:
            raise InvalidInputError(f"the file size limit {self.file_bytes} bytes is not within 1 byte..1 GiB"
                                    " (PyPI grants at most 1 GiB per file)")
        if self.quota_bytes <= 0:
            raise InvalidInputError(f"the project quota {self.quota_bytes} bytes must be positive")


@dataclass(frozen=True)
class PlannedFile:
    candidate: Candidate
    action: Action
    reason: str = ""


@dataclass
class UploadPlan:
    target: str
    version: str
    files: list[PlannedFile] = field(default_factory=list)
    project_bytes: int = 0
    unknown_sizes: int = 0  # files the index lists without a size (a PEP 503 page): not counted
    incoming_bytes: int = 0  # what the files that pass every per-file rule would add
    limits: Limits = field(default_factory=Limits)
    first_upload: datetime | None = None
    url: str = ""
    notes: list[str] = field(default_factory=list)  # what was chosen: the PyPI variant, the sdist

    @property
    def uploads(self) -> list[Candidate]:
        return [f.candidate for f in self.files if f.action == "upload"]

    @property
    def refusals(self) -> list[PlannedFile]:
        return [f for f in self.files if f.action == "refuse"]

    @property
    def projected_bytes(self) -> int:
        return self.project_bytes + self.incoming_bytes

    def to_markdown(self) -> str:
        """The plan as the approver reads it beside the release's own publish plan."""
        window = (f"first file of {self.version} uploaded {self.first_upload.isoformat(timespec='minutes')};"
                  f" new files accepted until {(self.first_upload + RELEASE_WINDOW).date().isoformat()}"
                  if self.first_upload else f"no file of {self.version} on the index yet")
        unknown = f" ({self.unknown_sizes} listed files of unknown size not counted)" if self.unknown_sizes else ""
        lines = [f"### Upload to `{self.target}` ({self.url or 'PyPI-compatible index'}), version {self.version}", "",
                 *(f"- {note}" for note in self.notes),
                 f"- project size: {_gib(self.project_bytes)} now, {_gib(self.projected_bytes)} after this upload,"
                 f" quota {_gib(self.limits.quota_bytes)}{unknown}",
                 f"- release window ({RELEASE_WINDOW.days} days from the first file): {window}", "",
                 "| file | size | limit | action | why |", "|---|---|---|---|---|"]
        lines += [f"| `{f.candidate.filename}` | {_mib(f.candidate.size)} | {_mib(self.limits.file_bytes)} |"
                  f" {f.action} | {f.reason.replace('|', '/')} |" for f in self.files]
        if not self.files:
            lines.append("| (nothing to upload) | | | | |")
        return "\n".join(lines) + "\n"


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else _mib(size)


def version_of(filename: str) -> Version:
    """The version a wheel or sdist name states; InvalidInputError naming the file otherwise."""
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename) as exc:
        raise InvalidInputError(f"{filename!r} is neither a PEP 427 wheel nor an sdist name: {exc}") from exc


def pypi_refusal(filename: str) -> str:
    """Why PyPI would refuse this file's name (a local version, a plain linux tag), or ""."""
    version = version_of(filename)
    if version.local is not None:
        return (f"{filename}: version {version} has a local label (+{version.local}); PyPI refuses local versions —"
                f" upload the designated variant re-versioned to {version.public}")
    if filename.endswith(".whl"):
        plain = sorted({t.platform for t in parse_wheel_filename(filename)[3] if t.platform.startswith("linux_")})
        if plain:
            return (f"{filename}: platform tag {', '.join(plain)} is refused by PyPI (a binary wheel needs a"
                    " manylinux or musllinux tag that says which systems it runs on)")
    return ""


def version_refusal(filename: str, version: Version) -> str:
    """Why a file of another version may not go up as part of release ``version`` (a static version an sdist's
    project did not bump, a wheel of another run), or ""."""
    stated = version_of(filename)
    if stated.public == version.public:
        return ""
    return (f"{filename}: version {stated} is not the release's {version}; every file of a release states its version"
            " (bump the project's version, or build the file from the release's run)")


def size_refusal(candidate: Candidate, limits: Limits) -> str:
    """Why the file is over the project's size limit, with its largest members, or ""."""
    if candidate.size <= limits.file_bytes:
        return ""
    members = ", ".join(f"{m.name} ({_mib(m.size)})" for m in candidate.largest[:LARGEST_LISTED])
    return (f"{candidate.filename} is {_mib(candidate.size)}, over the project's limit of {_mib(limits.file_bytes)}"
            f" (ask PyPI for a larger grant, at most 1 GiB, and set it in kiln.toml; or make the wheel smaller)."
            f" Largest members: {members or 'none listed'}")


def window_refusal(first: datetime | None, now: datetime, filename: str) -> str:
    """Why a new file may not join a release whose first file went up at ``first``, or ""."""
    if first is None or now - first <= RELEASE_WINDOW:
        return ""
    return (f"{filename}: release's first file was uploaded on {first.date().isoformat()}"
            f" ({(now - first).days} days ago); PyPI refuses new files on a release older than"
            f" {RELEASE_WINDOW.days} days — publish a new version (e.g. a .post release) instead")


def _judge(candidate: Candidate, held: dict[str, IndexFile], first: datetime | None, now: datetime,
           limits: Limits, version: Version) -> PlannedFile:
    existing = held.get(candidate.filename)
    if existing is not None:  # checked first: a file already there is never sent again
        if existing.sha256 == candidate.sha256:
            return PlannedFile(candidate, "skip", "already on the index with the same sha256; nothing sent")
        return PlannedFile(candidate, "refuse", f"{candidate.filename} is already on the index with sha256"
                           f" {existing.sha256}, not {candidate.sha256}; {IMMUTABLE_HINT}")
    why = pypi_refusal(candidate.filename) or version_refusal(candidate.filename, version) or size_refusal(
        candidate, limits) or window_refusal(first, now, candidate.filename)
    return PlannedFile(candidate, "refuse", why) if why else PlannedFile(candidate, "upload")


def _quota_refusals(plan: UploadPlan) -> None:
    if plan.projected_bytes <= plan.limits.quota_bytes:
        return
    why = (f"the project would hold {_gib(plan.projected_bytes)} after this upload ({_gib(plan.project_bytes)}"
           f" now), over its quota of {_gib(plan.limits.quota_bytes)}: delete old releases on PyPI or ask for more")
    plan.files = [PlannedFile(f.candidate, "refuse", why) if f.action == "upload" else f for f in plan.files]


def plan_upload(target: str, version: str, candidates: Sequence[Candidate], existing: Sequence[IndexFile],
                now: datetime, limits: Limits | None = None) -> UploadPlan:
    """Judge every candidate of release ``version`` against what the index holds and PyPI's rules."""
    public = Version(version)
    held = {f.filename: f for f in existing}
    times = [f.upload_time for f in existing if f.upload_time is not None and _same_release(f.filename, public)]
    plan = UploadPlan(target, version, limits=limits or Limits(), first_upload=min(times, default=None),
                      project_bytes=sum(f.size or 0 for f in existing),
                      unknown_sizes=sum(1 for f in existing if f.size is None))
    plan.files = [_judge(c, held, plan.first_upload, now, plan.limits, public) for c in candidates]
    plan.incoming_bytes = sum(c.size for c in plan.uploads)
    _quota_refusals(plan)
    return plan


def _same_release(filename: str, version: Version) -> bool:
    try:
        return version_of(filename) == version
    except InvalidInputError:
        return False  # an .egg or .exe of long ago: not a file of this release
