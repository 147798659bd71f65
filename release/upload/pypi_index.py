"""What a PyPI-compatible index already holds of a project: read from its simple API.

The project page is asked for PEP 691 JSON (PyPI answers it, with each file's
sha256, PEP 700 size and upload time); a server that answers PEP 503 HTML
(pypiserver) gives names and ``#sha256=`` fragments only, so sizes and upload
times are then unknown (the plan says so). Faults are typed where they are
met: a server that did not answer or answered 5xx/429 is a
:class:`~kiln.core.errors.TransientStoreError` (retried), anything else a
:class:`~kiln.core.errors.FetchError` naming the URL.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from datetime import UTC, datetime
from html.parser import HTMLParser
from typing import Any
from urllib.parse import unquote, urlsplit

from packaging.utils import canonicalize_name

from kiln.core.errors import FetchError, ThrottledError, TransientStoreError
from kiln.release.upload.pypi_plan import IndexFile

log = logging.getLogger(__name__)

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, text/html;q=0.1"
MAX_PAGE_BYTES = 64 << 20
TIMEOUT_S = 30.0
_CHUNK = 1 << 16


def project_page_url(index_url: str, project: str) -> str:
    return f"{index_url.rstrip('/')}/{canonicalize_name(project)}/"


def _body(url: str, timeout: float) -> tuple[bytes, str] | None:
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    log.info("reading %s (timeout %.0f s)", url, timeout)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read(MAX_PAGE_BYTES + 1)
            if len(body) > MAX_PAGE_BYTES:
                raise FetchError(f"{url}: the project page is larger than {MAX_PAGE_BYTES} bytes; not read")
            return body, response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        if exc.code == 429:
            raise ThrottledError(f"{url}: HTTP 429, the index asks to slow down") from exc
        if exc.code >= 500:
            raise TransientStoreError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}", exc.code) from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, DNS, socket timeout
        raise TransientStoreError(f"{url}: the index did not answer: {getattr(exc, 'reason', exc)}") from exc


# Any: a field of the index's JSON answer, checked here
def _time(value: Any, url: str) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError as exc:
        raise FetchError(f"{url}: upload-time {value!r} is not an ISO 8601 time") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _from_json(body: bytes, url: str) -> list[IndexFile]:
    try:
        files = json.loads(body)["files"]
        return [IndexFile(str(f["filename"]), str((f.get("hashes") or {}).get("sha256", "")),
                          int(f["size"]) if f.get("size") is not None else None, _time(f.get("upload-time"), url))
                for f in files]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FetchError(f"{url}: not a PEP 691 project page: {exc!r}") from exc


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.files: list[IndexFile] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href") if tag == "a" else None
        if href:
            split = urlsplit(href)
            algorithm, _, digest = split.fragment.partition("=")
            name = unquote(split.path.rsplit("/", 1)[-1])
            self.files.append(IndexFile(name, digest if algorithm == "sha256" else ""))


def read_index(index_url: str, project: str, timeout: float = TIMEOUT_S) -> list[IndexFile]:
    """Every file the index lists for ``project`` (none when it does not know the project)."""
    url = project_page_url(index_url, project)
    answer = _body(url, timeout)
    if answer is None:
        return []
    body, content_type = answer
    if content_type.split(";")[0].strip() == JSON_TYPE:
        return _from_json(body, url)
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    return parser.files
