"""Index pages from distributions: a pure function, deterministic to the byte.

Layout of one index root (the directory a user passes as ``--index-url``)::

    index.html, index.json                 root page (PEP 503 HTML, PEP 691 JSON)
    <project>/index.html, index.json       project page
    <project>/<filename>                   the file (written by the publisher)
    <project>/<filename>.metadata          its PEP 658 core-metadata sidecar

Every file link is relative (the file sits beside its page), carries
``#sha256=``, percent-encodes ``+`` as ``%2B`` (S3 and CDNs decode a bare ``+``
in a path as a space and answer 404), and advertises the sidecar with both
``data-dist-info-metadata`` (PEP 658) and ``data-core-metadata`` (PEP 714).
JSON pages are PEP 691 with PEP 700's ``versions``, ``size`` and
``upload-time``. Every project page carries its PEP 792 status marker
(``[project] status`` in kiln.toml, ``active`` by default): the HTML
``<meta name="pypi:project-status">`` (and ``pypi:project-status-reason`` when
there is a reason), the JSON ``"project-status": {"status", "reason"}``; the
status is written even when it is ``active`` (which an absent marker also
means), so a page always states it. Pages declare API version 1.4, the one
that defines the marker (1.2's and 1.3's fields are optional and not written).
Same input, same bytes: files are sorted by name, projects by normalised name,
JSON keys sorted.

A project's PEP 825 ``{name}-{version}-variants.json`` is listed under its own
name but linked at its immutable, content-addressed copy
(``variants/<sha256>/<name>``, :func:`variants_file_path`): installers take
the file name from the link's last segment.

A project page may also list files that live in another index on the same
target (a nightly's per-commit index lists the channel's wheels, see
:mod:`kiln.release.publish.protocol`): ``files_at`` is then the relative URL of the
directory that holds them, prepended to every file link.

Nothing here reads or writes storage; :mod:`kiln.release.publish.protocol` and
:mod:`kiln.release.cli` do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from html import escape
from json.encoder import encode_basestring_ascii as _js  # the string encoder json.dumps uses
from operator import attrgetter
from typing import Any, Literal, get_args
from urllib.parse import quote

from packaging.version import Version

from kiln.core.dists import (
    VARIANTS_JSON_SUFFIX,
    Distribution,
    check_filename,
    make_distribution,
    parse_upload_time,
)
from kiln.core.errors import IntegrityError, InvalidInputError

API_VERSION = "1.4"  # PEP 792 (project status markers) is 1.4
Status = Literal["active", "archived", "quarantined", "deprecated"]  # PEP 792's markers
STATUSES: tuple[Status, ...] = get_args(Status)
HTML_TYPE = "text/html; charset=utf-8"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
HTML_PAGE = "index.html"
JSON_PAGE = "index.json"
_META_TAG = f'<meta name="pypi:repository-version" content="{API_VERSION}">'
_URL_SAFE = re.compile(r"[A-Za-z0-9._~+-]+\Z")
_PREFIX_SAFE = re.compile(r"(?:[A-Za-z0-9._~%-]+/)*\Z")  # a relative directory URL: percent-encoded segments
_REASON_BAD = re.compile(r"[\x00-\x1f\x7f]")
MAX_REASON = 500
_filename = attrgetter("filename")
VARIANTS_DIR = "variants"  # under a project's directory: the content-addressed copies of its variants files


def variants_file_path(filename: str, sha256: str) -> str:
    """Where a project's ``{name}-{version}-variants.json`` with ``sha256`` lies, relative to its project directory.

    The variants file changes (labels are added) while the wheels it describes do not, so a page never links
    one mutable object: each content is stored once, immutable, under its own hash, and the page links the copy
    its hash names, so every link matches its hash at every instant (invariant 1) however the pages race.
    """
    return f"{VARIANTS_DIR}/{sha256}/{filename}"


@dataclass(frozen=True)
class ProjectStatus:
    """A project's PEP 792 status marker and its free-form reason, as its pages state them."""

    status: Status = "active"
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise InvalidInputError(f"project status {self.status!r} is not one of {', '.join(STATUSES)} (PEP 792)")
        if not isinstance(self.reason, str) or _REASON_BAD.search(self.reason) or len(self.reason) > MAX_REASON:
            raise InvalidInputError(f"project status reason {self.reason!r} must be one line of text without control"
                                    f" characters, at most {MAX_REASON} characters")

    def html(self) -> str:
        lines = f'    <meta name="pypi:project-status" content="{self.status}">\n'
        if self.reason:
            lines += f'    <meta name="pypi:project-status-reason" content="{escape(self.reason)}">\n'
        return lines

    def json(self) -> str:
        """The ``"project-status"`` member, keys sorted as json.dumps(sort_keys=True) writes them."""
        reason = f'"reason":{_js(self.reason)},' if self.reason else ""
        return f'"project-status":{{{reason}"status":"{self.status}"}}'


ACTIVE = ProjectStatus()


@lru_cache(maxsize=1 << 16)  # versions repeat across projects
def _version_order(version: str) -> Any:
    parsed = Version(version)
    # packaging orders Versions by this tuple; sorting by it directly compares in C instead of
    # calling Version.__lt__ per comparison. The Version itself if a packaging lacks it.
    return getattr(parsed, "_key", parsed)


def file_url(filename: str) -> str:
    """The relative, percent-encoded URL of a file beside its page ('+' becomes %2B)."""
    if _URL_SAFE.match(filename):  # the usual wheel name: only '+' needs encoding
        return filename.replace("+", "%2B")
    return quote(filename, safe="")


def group(dists: Iterable[Distribution]) -> dict[str, list[Distribution]]:
    """Distributions by project, each list sorted by filename.

    The same filename twice with the same record is one file; with a
    different hash it is refused — an index must never name two contents.
    """
    dists = list(dists)
    by_name = {dist.filename: dist for dist in dists}  # the last record of a name, as below
    if len(by_name) != len(dists):
        by_name = {}
        for dist in dists:
            seen = by_name.get(dist.filename)
            if seen is not None and seen.sha256 != dist.sha256:
                raise IntegrityError(f"{dist.filename} is listed twice with different sha256"
                                     f" ({seen.sha256}, {dist.sha256})")
            by_name[dist.filename] = dist
    projects: dict[str, list[Distribution]] = {}
    for dist in sorted(by_name.values(), key=_filename):
        projects.setdefault(dist.project, []).append(dist)
    return projects


@lru_cache(maxsize=1024)  # a whole index shares a handful of specifiers
def _requires_python(value: str) -> tuple[str, str]:
    """The HTML attribute and the JSON member of a ``Requires-Python`` value."""
    return f' data-requires-python="{escape(value)}"', f'"requires-python":{_js(value)},'


def _html(title: str, body: Iterable[str], meta: str = "") -> bytes:
    head = (
        f"<!DOCTYPE html>\n<html>\n  <head>\n    {_META_TAG}\n{meta}    <title>{escape(title)}</title>\n  </head>\n"
        f"  <body>\n    <h1>{escape(title)}</h1>\n"
    )
    return (head + "".join(body) + "  </body>\n</html>\n").encode()


def _json(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _file_entries(dist: Distribution, prefix: str = "") -> tuple[str, str]:
    """The HTML anchor and the PEP 691 JSON object of one file.

    The JSON is what ``json.dumps(entry, sort_keys=True, separators=(",", ":"))``
    gives for the entry (keys in sorted order, strings through the same
    encoder), written out because one dumps call per file costs more than the
    rest of the page; a golden copy of pages made with dumps guards it.
    """
    filename, sha, meta = dist.filename, dist.sha256, dist.metadata_sha256
    requires, yanked = dist.requires_python, dist.yanked
    if _URL_SAFE.match(filename):  # the usual wheel name: nothing to escape, only '+' to encode
        url = filename.replace("+", "%2B")
        text, filename_json, url_json = filename, f'"{filename}"', f'"{url}"'
    else:
        url = quote(filename, safe="")
        text, filename_json, url_json = escape(filename), _js(filename), _js(url)
    if filename.endswith(VARIANTS_JSON_SUFFIX):  # its immutable copy of these bytes, see variants_file_path
        url = variants_file_path(url, sha)
        url_json = _js(url)
    if prefix:  # checked URL-safe by project_pages: nothing in it to escape
        url, url_json = prefix + url, f'"{prefix}{url_json[1:]}'
    requires_attr, requires_json = _requires_python(requires) if requires else ("", "")
    if meta:
        meta_attr = f' data-dist-info-metadata="sha256={meta}" data-core-metadata="sha256={meta}"'
        head = f'{{"core-metadata":{{"sha256":"{meta}"}},"dist-info-metadata":{{"sha256":"{meta}"}},'
    else:
        meta_attr, head = "", "{"
    if yanked is None:
        yanked_attr, yanked_json = "", "false"
    else:
        yanked_attr, yanked_json = f' data-yanked="{escape(yanked)}"', _js(yanked) if yanked else "true"
    return (f'    <a href="{url}#sha256={sha}"{requires_attr}{meta_attr}{yanked_attr}>{text}</a><br>\n',
            f'{head}"filename":{filename_json},"hashes":{{"sha256":"{sha}"}},{requires_json}"size":{dist.size},'
            f'"upload-time":"{dist.upload_time_iso}","url":{url_json},"yanked":{yanked_json}}}')


def project_pages(project: str, dists: Sequence[Distribution], status: ProjectStatus = ACTIVE,
                  files_at: str = "") -> dict[str, bytes]:
    """The HTML and JSON page of one project (``dists`` as :func:`group` returns them).

    ``files_at``: the relative URL (ending in "/") of the directory that holds
    the files when it is not the page's own, e.g. ``../../../../simple/demo/``.
    """
    if not _PREFIX_SAFE.match(files_at):
        raise InvalidInputError(f"files_at {files_at!r} must be a relative directory URL of percent-encoded segments,"
                                " ending in '/'")
    versions = sorted({d.version for d in dists}, key=_version_order)
    entry = _file_entries if not files_at else lambda dist: _file_entries(dist, files_at)
    anchors, entries = zip(*map(entry, dists), strict=True) if dists else ((), ())
    html = _html(f"Links for {project}", anchors, status.html())
    # {"files", "meta", "name", "project-status", "versions"}: json.dumps with sorted keys, as in _file_entries
    data = (f'{{"files":[{",".join(entries)}],"meta":{{"api-version":"{API_VERSION}"}},"name":{_js(project)},'
            f'{status.json()},"versions":[{",".join(map(_js, versions))}]}}\n')
    return {f"{project}/{HTML_PAGE}": html, f"{project}/{JSON_PAGE}": data.encode()}


def root_pages(projects: Iterable[str]) -> dict[str, bytes]:
    names = sorted(set(projects))
    html = _html("Simple index", (f'    <a href="{quote(n)}/">{escape(n)}</a><br>\n' for n in names))
    data = {"meta": {"api-version": API_VERSION}, "projects": [{"name": n} for n in names]}
    return {HTML_PAGE: html, JSON_PAGE: _json(data)}


def generate(dists: Iterable[Distribution]) -> dict[str, bytes]:
    """Every page of an index: ``{relative path: bytes}``."""
    projects = group(dists)
    pages = root_pages(projects)
    for project, files in projects.items():
        pages.update(project_pages(project, files))
    return pages


def regenerate(previous: Iterable[Distribution], current: Iterable[Distribution]) -> dict[str, bytes]:
    """Only the pages that differ between two index states.

    A project page is rendered again only when its file set changed; the root
    only when the set of projects did. Adding one wheel to an existing project
    therefore renders one project's two pages and nothing else.
    """
    before, after = group(previous), group(current)
    pages: dict[str, bytes] = {}
    for project, files in after.items():
        if before.get(project) != files:
            pages.update(project_pages(project, files))
    if set(before) != set(after):
        pages.update(root_pages(after))
    return pages


def parse_project_json(data: bytes, where: str) -> list[Distribution]:
    """Read back a PEP 691 project page this module wrote (the publisher merges into it)."""
    try:
        page = json.loads(data)
        files = page["files"]
        return [
            make_distribution(
                check_filename(f["filename"]),
                f["hashes"]["sha256"],
                f["size"],
                parse_upload_time(f["upload-time"], where),
                f.get("requires-python"),
                (f.get("core-metadata") or {}).get("sha256") if isinstance(f.get("core-metadata"), dict) else None,
                None if f.get("yanked") in (None, False) else ("" if f["yanked"] is True else f["yanked"]),
            )
            for f in files
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{where} is not a PEP 691 project page Kiln can merge into: {exc!r}") from exc


def parse_root_json(data: bytes, where: str) -> list[str]:
    try:
        return [p["name"] for p in json.loads(data)["projects"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"{where} is not a PEP 691 root page: {exc!r}") from exc
