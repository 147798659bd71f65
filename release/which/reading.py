"""``kiln which``'s reading side: one project's wheels on an index, with what each asks, and the install command.

The index is read as ``kiln verify`` reads it (:func:`kiln.release.read.fetch.open_source`: ``file://``,
``http(s)://``, ``s3://``; the PEP 691 JSON form, else PEP 503 HTML): the root page for the projects it
holds, the project page for its files and their ``data-requires-python``, and each wheel's PEP 658
metadata sidecar of the chosen version for its ``Requires-Dist`` (the torch it asks for). Only the sidecars
of one version are read, never a wheel. :mod:`kiln.release.which.pick` then chooses. A PEP 825 variant wheel
(``…-linux_x86_64-cu130.whl``, on a combined ``wheel-variants`` index) is not a PEP 427 name and is not
considered: there the plain default wheel is the one pip would install.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from packaging.metadata import parse_email
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kiln.core.errors import FetchError, InvalidInputError
from kiln.core.wheels import member_limit
from kiln.release.install.installer import held_requirements, pip_steps, printed_pip
from kiln.release.read.fetch import IndexSource, Page, file_bytes, open_source
from kiln.release.read.pageforms import anchors, filename_of, html_files, json_files
from kiln.release.which.pick import Candidate

log = logging.getLogger(__name__)

RUNTIME = "kiln-runtime"  # beside every project on a Kiln index; never the one asked about by default


@dataclass(frozen=True)
class Listing:
    """One version's wheels of a project on an index, and what the index holds (for the command)."""

    project: str
    version: Version
    candidates: tuple[Candidate, ...]
    requires: dict[str, list[str]]  # Requires-Dist by filename (from the sidecars)
    holds: frozenset[str]  # canonical names of the projects the index holds
    public_versions: tuple[Version, ...]  # every version on the index, newest first


def _projects(source: IndexSource) -> list[str]:
    page = source.page(source.root)
    names = {canonicalize_name((a.get("href") or "").rstrip("/").rsplit("/", 1)[-1]) for a in anchors(page)}
    return sorted(name for name in names if name)


def _project(asked: str | None, held: list[str], url: str) -> str:
    if asked is not None:
        name = canonicalize_name(asked)
        if name not in held:
            raise InvalidInputError(f"{url} holds no project {asked!r}; it holds {', '.join(held) or 'nothing'}")
        return name
    own = [name for name in held if name != RUNTIME]
    if len(own) != 1:
        raise InvalidInputError(f"{url} holds {', '.join(held) or 'no project'}: name one with --project")
    return own[0]


def _requires_python(page: Page) -> dict[str, SpecifierSet | None]:
    found: dict[str, SpecifierSet | None] = {}
    for anchor in anchors(page):
        name, value = filename_of(anchor.get("href") or ""), anchor.get("data-requires-python")
        try:
            found[name] = SpecifierSet(value) if value else None
        except InvalidSpecifier:
            log.warning("%s: %s has an invalid data-requires-python %r; not checked", page.url, name, value)
            found[name] = None
    return found


def _wheels(page: Page) -> dict[str, tuple[Version, bool, str, bool]]:
    """filename -> (version, yanked, url, has a sidecar) of every wheel the page lists (other files skipped)."""
    problems: list[str] = []
    refs = json_files(page, problems) if page.json is not None else html_files(page, problems)
    wheels = {}
    for name, ref in refs.items():
        try:
            version = parse_wheel_filename(name)[1]
        except InvalidWheelFilename:
            continue
        wheels[name] = (version, ref.yanked, ref.url, ref.metadata is not None)
    return wheels


def _pick_version(versions: list[Version], asked: str | None, project: str) -> Version:
    """The asked public version, else the newest final release (the newest pre-release when there is none)."""
    if asked is not None:
        try:
            wanted = Version(asked)
        except InvalidVersion as exc:
            raise InvalidInputError(f"--version {asked!r} is not a PEP 440 version") from exc
        match = [v for v in versions if v == wanted or Version(v.public) == wanted]
        if not match:
            have = ", ".join(str(v) for v in sorted({Version(v.public) for v in versions}, reverse=True))
            raise InvalidInputError(f"{project} has no version {asked} on this index; it has {have or 'none'}")
        return Version(match[0].public) if not wanted.local else wanted
    finals = [v for v in versions if not v.is_prerelease]
    return Version(max(finals or versions).public)


def _requires_dist(source: IndexSource, url: str) -> list[str]:
    raw, _ = parse_email(file_bytes(source, url + ".metadata", member_limit("METADATA")))
    return [str(line) for line in raw.get("requires_dist") or []]


def torch_specifier(requires: Sequence[str]) -> SpecifierSet | None:
    """The torch a wheel asks for (its non-extra ``Requires-Dist: torch…`` lines, joined); None if none."""
    found = None
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) == "torch" and "extra" not in str(requirement.marker or ""):
            found = requirement.specifier if found is None else found & requirement.specifier
    return found


def read_listing(url: str, project: str | None, version: str | None, timeout: float) -> Listing:
    """The wheels of ``project`` (or the index's one project) at ``version`` (or its newest) on ``url``."""
    source = open_source(url, timeout)
    held = _projects(source)
    name = _project(project, held, url)
    page = source.page(f"{source.root}{name}/")
    wheels = {f: w for f, w in _wheels(page).items() if not w[1]}  # a yanked wheel is never chosen
    if not wheels:
        raise FetchError(f"{page.url}: no wheel of {name} that is not yanked")
    chosen = _pick_version([w[0] for w in wheels.values()], version, name)
    python = _requires_python(page)
    candidates, requires = [], {}
    for filename, (v, _, file_url, sidecar) in sorted(wheels.items()):
        if v != chosen and Version(v.public) != chosen:
            continue
        requires[filename] = _requires_dist(source, file_url) if sidecar else []
        torch = torch_specifier(requires[filename]) if sidecar else None
        candidates.append(Candidate(filename, python.get(filename), torch))
    versions = tuple(sorted({w[0] for w in wheels.values()}, reverse=True))
    return Listing(name, chosen, tuple(candidates), requires, frozenset(held), versions)


def requirement_for(listing: Listing, candidate: Candidate) -> str:
    """``name==version`` of the chosen wheel; ``===`` for a version with no local label whose siblings have one,
    since ``==0.1.0`` also matches ``0.1.0+cu130``, which pip ranks higher."""
    version = candidate.version
    shadowed = not version.local and any(v.local and v.public == version.public for v in listing.public_versions)
    return f"{listing.project}{'===' if shadowed else '=='}{version}"


def install_command(url: str, listing: Listing, candidate: Candidate, extra_index_urls: Sequence[str]) -> str:
    """Kiln's pip command for the wheel (:func:`kiln.release.install.installer.pip_steps`: the names the index
    holds from
    it alone first when extra indexes are named; :func:`~kiln.release.install.installer.held_requirements` says
    which)."""
    held = held_requirements(listing.requires.get(candidate.filename, []), listing.holds)
    root = url if url.endswith("/") else url + "/"
    steps = pip_steps(root, requirement_for(listing, candidate), held, extra_index_urls)
    return printed_pip(steps)
