"""Read an index's pages and files from the URL a user was given, whatever serves it.

A *source* answers two questions for :mod:`kiln.release.verify`: "what are the
HTML and JSON forms of this page?" and "what are the bytes of this file?".
Three kinds exist, chosen by the URL's scheme (:func:`open_source`):

* ``http://`` / ``https://`` — :class:`HttpSource`. The HTML form is the page
  URL asked for ``text/html``. The JSON form is the page URL asked for PEP 691
  JSON by ``Accept``; a server that does no content negotiation (a plain
  static server such as ``python -m http.server``, an S3 website endpoint,
  a CDN over a bucket) answers with its directory index file, HTML, so the
  JSON form is then read from ``<page>/index.json``. A static mirror may have
  no JSON at all; the page then has only its HTML form (``json is None``).
* ``file://`` — a :class:`StoreSource` over a local directory: a directory URL
  reads ``index.html`` and ``index.json`` from disk, a file URL reads the file.
* ``s3://bucket/prefix/…`` — a :class:`StoreSource` over Kiln's S3 store,
  opened with the publish target's settings (region, endpoint, expected
  owner) and the caller's credentials. S3's REST endpoint serves no directory
  index documents, so an index in a bucket is verified here, by key; pip and
  uv install it through :class:`kiln.release.serve.IndexServer`.

Every failure is a :class:`~kiln.release.errors.FetchError` naming the URL.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urldefrag, urljoin, urlsplit
from urllib.request import url2pathname

from kiln.release.errors import FetchError, InvalidInputError, KilnError
from kiln.release.index import HTML_PAGE, JSON_PAGE, JSON_TYPE
from kiln.release.store import LocalStore, Store, open_store

log = logging.getLogger("kiln.fetch")

HTML_ACCEPT = "text/html"
_JSON_TYPES = (JSON_TYPE, "application/vnd.pypi.simple.latest+json")
_ABSENT = (403, 404, 410)  # S3 answers 403 for a missing key when listing is not allowed


@dataclass(frozen=True)
class Page:
    """Both forms of one index page; ``json_url`` says where the JSON form came from."""

    url: str
    html: bytes
    json: Any | None  # the parsed PEP 691 document, None when the index has no JSON form of this page
    json_url: str | None


@dataclass(frozen=True)
class StoreSettings:
    """How to open an ``s3://`` URL: the publish target's settings and the caller's boto3 session."""

    region: str | None = None
    endpoint: str | None = None
    expected_owner: str | None = None
    session: Any = None


class Source(Protocol):
    root: str  # the index URL, ending in "/"
    negotiates: bool  # False once the server answered a JSON request with HTML

    def page(self, url: str) -> Page:
        """The page at ``url`` (ending in "/"); FetchError when its HTML form cannot be read."""

    def file(self, url: str) -> bytes:
        """The bytes at ``url``; FetchError when they cannot be read."""


def join(base: str, ref: str) -> str:
    """``urljoin`` for every scheme Kiln prints, ``s3://`` included (urllib joins only schemes it knows)."""
    scheme = urlsplit(base).scheme
    if scheme != "s3":
        return urljoin(base, ref)
    joined = urljoin("http" + base[len(scheme):], ref)  # http has the same path rules
    return "s3" + joined[len("http"):] if joined.startswith("http://") else joined


def _parse_json(data: bytes, url: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise FetchError(f"{url}: the PEP 691 JSON page is not valid JSON: {exc}") from exc


class HttpSource:
    """An index behind an HTTP server, with or without PEP 691 content negotiation."""

    def __init__(self, root: str, timeout: float) -> None:
        self.root, self.timeout, self.negotiates = root, timeout, True

    def _get(self, url: str, accept: str | None) -> tuple[bytes, str]:
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - http(s) only
                return response.read(), response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}", status=exc.code) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise FetchError(f"{url}: {exc}") from exc

    def _optional(self, url: str, accept: str) -> tuple[bytes, str] | None:
        try:
            return self._get(url, accept)
        except FetchError as exc:
            if exc.status in _ABSENT:
                return None
            raise

    def page(self, url: str) -> Page:
        html, _ = self._get(url, HTML_ACCEPT)
        negotiated = self._optional(url, JSON_TYPE)
        if negotiated is not None and negotiated[1].split(";")[0].strip() in _JSON_TYPES:
            return Page(url, html, _parse_json(negotiated[0], url), url)
        if negotiated is not None:  # asked for JSON, got the directory's HTML: no negotiation here
            self.negotiates = False
        json_url = urljoin(url, JSON_PAGE)
        static = self._optional(json_url, JSON_TYPE)
        if static is None:
            return Page(url, html, None, None)
        return Page(url, html, _parse_json(static[0], json_url), json_url)

    def file(self, url: str) -> bytes:
        return self._get(url, None)[0]


class StoreSource:
    """An index held in a Kiln store (a local directory or an S3 prefix), read by key."""

    negotiates = True  # pages are read by name: both forms, whenever both exist

    def __init__(self, store: Store, root: str) -> None:
        self.store, self.root = store, root

    def _key(self, url: str, page: str = "") -> str:
        path = urldefrag(url)[0]
        if not path.startswith(self.root):
            raise FetchError(f"{url}: outside the index {self.root}; a store source reads only its own keys")
        return unquote(path[len(self.root):]) + page

    def _get(self, url: str, page: str = "") -> bytes | None:
        try:
            return self.store.get(self._key(url, page))
        except KilnError as exc:  # a bad key, a refused or failed read: a problem of this URL
            raise FetchError(f"{url}{page}: {exc}") from exc

    def page(self, url: str) -> Page:
        html = self._get(url, HTML_PAGE)
        if html is None:
            raise FetchError(f"{url}: no {HTML_PAGE} in {self.store.url}")
        data = self._get(url, JSON_PAGE)
        json_url = url + JSON_PAGE
        return Page(
            url, html, None if data is None else _parse_json(data, json_url), None if data is None else json_url
        )

    def file(self, url: str) -> bytes:
        data = self._get(url)
        if data is None:
            raise FetchError(f"{url}: not found in {self.store.url}")
        return data


def local_path(url: str) -> Path:
    """The directory a ``file://`` URL names; a remote host is refused."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidInputError(
            f"{url}: a file:// URL must name a local path (file:///abs/dir/), not host {parts.netloc!r}"
        )
    if not parts.path:
        raise InvalidInputError(f"{url} names no directory")
    return Path(url2pathname(unquote(parts.path)))


def open_source(url: str, timeout: float, settings: StoreSettings | None = None) -> Source:
    """The source for an index URL (normalised to end in "/"); InvalidInputError for other schemes."""
    root = url if url.endswith("/") else url + "/"
    scheme = urlsplit(root).scheme
    if scheme in ("http", "https"):
        return HttpSource(root, timeout)
    if scheme == "file":
        directory = local_path(root)
        if not directory.is_dir():
            raise InvalidInputError(f"{url}: {directory} is not a directory")
        return StoreSource(LocalStore(directory), root)
    if scheme == "s3":
        settings = settings or StoreSettings()
        store = open_store(root.rstrip("/"), root=Path("."), region=settings.region, endpoint=settings.endpoint,
                           expected_owner=settings.expected_owner, session=settings.session)
        log.info("reading %s through %s", root, store.url)
        return StoreSource(store, root)
    raise InvalidInputError(f"index URL {url!r}: scheme must be http://, https://, file:// or s3://")
