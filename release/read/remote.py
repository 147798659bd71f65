"""The newest release of a project on someone else's index (an extra index such as PyPI).

Why: an install hint names the Kiln index and the extra indexes its
dependencies come from. pip and uv merge the candidates of all of them, so a
release of the same name on an extra index that sorts above the run's version
(a nightly ``0.8.2.dev…`` is below PyPI's ``0.8.5``) is what an unpinned
install takes. :func:`newest_release` reads that index's project page — the
PEP 691 JSON form when the server offers it, else the PEP 503 HTML — with a
deadline and a size cap, and never raises for an index it cannot read: the
answer is then ``unknown`` with the reason, for the run to note and go on.

``file://`` indexes are read from disk (``<project>/index.json`` or
``index.html``), which is how the tests stand in for PyPI.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from kiln.core.errors import FetchError

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # the whole read of one page, not each socket operation
MAX_PAGE_BYTES = 8 << 20  # a project page of PyPI's largest projects is a few MiB
_CHUNK = 1 << 16
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
_JSON_TYPES = ("application/vnd.pypi.simple.v1+json", "application/vnd.pypi.simple.latest+json",
               "application/json")
_ABSENT = (404, 410)

LookupState = Literal["found", "absent", "unknown"]


@dataclass(frozen=True)
class Lookup:
    """What one index says about one project: its newest final release, or why that is not known."""

    index_url: str
    state: LookupState
    newest: str | None = None  # the newest non-yanked final release ("found" only; None: only pre-releases)
    reason: str = ""  # why "unknown"


def project_url(index_url: str, project: str) -> str:
    return f"{index_url.rstrip('/')}/{canonicalize_name(project)}/"


def _read_http(url: str, timeout: float, max_bytes: int) -> tuple[bytes, str] | None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise FetchError(f"{url}: the page is larger than {max_bytes} bytes; not read further")
                if time.monotonic() > deadline:
                    raise FetchError(f"{url}: not read within {timeout:.0f} s")
            return bytes(body), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        if exc.code in _ABSENT:
            return None
        raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, DNS, socket timeout
        raise FetchError(f"{url}: {getattr(exc, 'reason', exc)}") from exc


def _read_file(url: str, max_bytes: int) -> tuple[bytes, str] | None:
    directory = Path(url2pathname(unquote(urlsplit(url).path)))
    for name, kind in (("index.json", _JSON_TYPES[0]), ("index.html", "text/html")):
        path = directory / name
        if path.is_file():
            if path.stat().st_size > max_bytes:
                raise FetchError(f"{path}: larger than {max_bytes} bytes; not read")
            return path.read_bytes(), kind
    return None


def read_page(url: str, timeout: float = TIMEOUT_S, max_bytes: int = MAX_PAGE_BYTES) -> tuple[bytes, str] | None:
    """A project page's bytes and content type; None when the index does not have the project."""
    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        log.info("reading %s (deadline %.0f s, at most %d bytes)", url, timeout, max_bytes)
        return _read_http(url, timeout, max_bytes)
    if scheme == "file":
        return _read_file(url, max_bytes)
    raise FetchError(f"{url}: only http(s):// and file:// indexes can be read")


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.files: list[tuple[str, bool]] = []
        self._yanked = False
        self._text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._yanked, self._text = any(k == "data-yanked" for k, _ in attrs), []

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._text is not None:
            self.files.append(("".join(self._text).strip(), self._yanked))
            self._text = None


def listed_files(body: bytes, content_type: str, url: str) -> list[tuple[str, bool]]:
    """(filename, yanked) of every file a PEP 691 JSON or PEP 503 HTML project page lists."""
    if content_type.split(";")[0].strip() in _JSON_TYPES:
        try:
            data: Any = json.loads(body)
            return [(str(f["filename"]), f.get("yanked") not in (None, False)) for f in data.get("files", [])]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FetchError(f"{url}: not a PEP 691 project page: {exc}") from exc
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    return parser.files


def _version(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None  # another kind of file (an .egg, a .exe): pip and uv would not pick it either


def newest_final(files: Iterable[tuple[str, bool]]) -> Version | None:
    """The newest non-yanked final release (what ``pip install NAME`` picks); pre- and dev releases do not count."""
    versions = [v for name, yanked in files if not yanked and (v := _version(name)) is not None]
    finals = [v for v in versions if not v.is_prerelease]
    return max(finals, default=None)


def newest_release(index_url: str, project: str, timeout: float = TIMEOUT_S,
                   max_bytes: int = MAX_PAGE_BYTES) -> Lookup:
    """The newest final release of ``project`` on ``index_url``; ``unknown`` with the reason when unreadable."""
    url = project_url(index_url, project)
    try:
        page = read_page(url, timeout, max_bytes)
        if page is None:
            return Lookup(index_url, "absent")
        newest = newest_final(listed_files(page[0], page[1], url))
    except FetchError as exc:
        log.warning("could not read %s: %s", url, exc)
        return Lookup(index_url, "unknown", reason=str(exc))
    return Lookup(index_url, "found", None if newest is None else str(newest))
