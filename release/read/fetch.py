"""Read an index's pages and files from the URL a user was given, whatever serves it.

A *source* answers two questions for :mod:`kiln.release.read.verify`: "what are the
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
  uv install it through :class:`kiln.release.read.serve.IndexServer`.

Every failure is a :class:`~kiln.core.errors.FetchError` naming the URL.

A source reads only what its index may serve: an HTTP source fetches http(s)
URLs on the index's own origin (scheme, host, port) and on the extra indexes
the caller names, redirects included; a store source reads keys below its
root, and a local file only while its links stay inside the directory. Any
other link is a :class:`~kiln.core.errors.LinkRefusedError`, raised before
anything is fetched. Every read streams under a cap — a file's declared size,
else :attr:`FetchLimits.max_file_bytes`; a page's
:attr:`FetchLimits.max_page_bytes` — and a per-file deadline, past which it
stops with :class:`~kiln.core.errors.TooLargeError`.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import unquote, urldefrag, urljoin, urlsplit
from urllib.request import url2pathname

from kiln.core.errors import (
    FetchError,
    InvalidInputError,
    KilnError,
    LinkRefusedError,
    TooLargeError,
    UnsafePathError,
)
from kiln.core.objects import BotoSession
from kiln.core.store import LocalStore, Store, is_remote, open_store
from kiln.release.index.render import HTML_PAGE, JSON_PAGE, JSON_TYPE

log = logging.getLogger(__name__)

HTML_ACCEPT = "text/html"
_JSON_TYPES = (JSON_TYPE, "application/vnd.pypi.simple.latest+json")
_ABSENT = (403, 404, 410)  # S3 answers 403 for a missing key when listing is not allowed
_CHUNK = 1 << 16


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
    session: BotoSession | None = None


class Sink(Protocol):
    """Where a download's bytes go (a file, a hashing writer, a BytesIO)."""

    def write(self, data: bytes, /) -> object: ...


@dataclass(frozen=True)
class FetchLimits:
    """Caps on what verification reads: every download stops at its cap or its deadline, whichever comes first.

    A file's cap is the size its page declares (the JSON form's ``size``), at
    most ``max_file_bytes``; without a declared size, ``max_file_bytes``.
    """

    max_file_bytes: int = 4 << 30
    max_page_bytes: int = 64 << 20
    file_deadline_s: float = 600.0


class IndexSource(Protocol):
    root: str  # the index URL, ending in "/"
    negotiates: bool  # False once the server answered a JSON request with HTML
    limits: FetchLimits

    def page(self, url: str) -> Page:
        """The page at ``url`` (ending in "/"); FetchError when its HTML form cannot be read."""

    def download(self, url: str, sink: Sink, limit: int) -> None:
        """Stream the bytes at ``url`` into ``sink``, at most ``limit`` of them.

        LinkRefusedError when ``url`` is not this index's to serve (nothing is
        fetched); TooLargeError when the body runs past ``limit`` or the
        per-file deadline; FetchError when it cannot be read."""


def file_bytes(source: IndexSource, url: str, limit: int) -> bytes:
    """The bytes at ``url`` held in memory: only for what is small by its cap (a sidecar)."""
    buffer = io.BytesIO()
    source.download(url, buffer, limit)
    return buffer.getvalue()


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


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of an http(s) URL, the port made explicit; what "the same server" means here."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port if port is not None else default


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed origin; elsewhere the redirect is refused, not followed."""

    def __init__(self, check: Callable[[str], None]) -> None:
        super().__init__()
        self.check = check

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: http.client.HTTPMessage, newurl: str) -> urllib.request.Request | None:
        self.check(urljoin(req.full_url, newurl))
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpSource:
    """An index behind an HTTP server, with or without PEP 691 content negotiation.

    Reads only http(s) URLs on the index's own origin and on ``allowed`` (the
    extra indexes' URLs): any other link of a page, a redirect included, is
    refused with LinkRefusedError before a connection is made.
    """

    def __init__(self, root: str, timeout: float, allowed: Sequence[str] = (),
                 limits: FetchLimits | None = None) -> None:
        self.root, self.timeout, self.negotiates = root, timeout, True
        self.limits = limits or FetchLimits()
        self.origins = {origin(root), *(origin(url) for url in allowed if urlsplit(url).scheme in ("http", "https"))}
        self._opener = urllib.request.build_opener(_SameOriginRedirects(self.check))

    def check(self, url: str) -> None:
        if urlsplit(url).scheme not in ("http", "https") or origin(url) not in self.origins:
            scheme, host, port = origin(self.root)
            raise LinkRefusedError(f"{url}: refused, not fetched: an index on {scheme}://{host}:{port} may link only"
                                   " http(s) URLs on its own server (or on an extra index named by the caller)")

    def _stream(self, url: str, accept: str | None, sink: Sink, limit: int) -> str:
        """Stream ``url`` into ``sink``; its Content-Type."""
        self.check(url)
        deadline = time.monotonic() + self.limits.file_deadline_s
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        try:
            with self._opener.open(request, timeout=min(self.timeout, self.limits.file_deadline_s)) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise TooLargeError(f"{url}: the server announces {declared} bytes, over the cap of {limit}"
                                        " (the size the page declares, or the configured maximum); not read")
                _copy_capped(url, response, sink, limit, deadline)
                return str(response.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as exc:
            raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}", status=exc.code) from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise FetchError(f"{url}: {exc}") from exc

    def _get(self, url: str, accept: str | None) -> tuple[bytes, str]:
        buffer = io.BytesIO()
        content_type = self._stream(url, accept, buffer, self.limits.max_page_bytes)
        return buffer.getvalue(), content_type

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

    def download(self, url: str, sink: Sink, limit: int) -> None:
        self._stream(url, None, sink, limit)


def _copy_capped(url: str, response: http.client.HTTPResponse, sink: Sink, limit: int, deadline: float) -> None:
    """Copy the body into ``sink`` one receive at a time, stopping past ``limit`` bytes or the deadline."""
    total = 0
    while True:
        block = response.read1(_CHUNK)
        if not block:
            return
        total += len(block)
        if total > limit:
            raise TooLargeError(f"{url}: the body runs past the cap of {limit} bytes (the size the page declares,"
                                " or the configured maximum); reading stopped there")
        if time.monotonic() > deadline:
            raise TooLargeError(f"{url}: not read within its deadline ({total} bytes so far); reading stopped")
        sink.write(block)


class StoreSource:
    """An index held in a Kiln store (a local directory or an S3 prefix), read by key.

    Only keys below the index's root are read: any other URL a page links is
    refused (LinkRefusedError), and so is a local file whose links lead out
    of the store's directory.
    """

    negotiates = True  # pages are read by name: both forms, whenever both exist

    def __init__(self, store: Store, root: str, limits: FetchLimits | None = None, scope: str | None = None) -> None:
        self.store, self.root, self.limits = store, root, limits or FetchLimits()
        # What may be read: the index itself, or for a per-commit index the variant's directory whose
        # channel index holds the files its pages link (the store is opened there).
        self.scope = scope or root

    def _key(self, url: str, page: str = "") -> str:
        path = urldefrag(url)[0]
        if not path.startswith(self.scope):
            raise LinkRefusedError(f"{url}: refused, not read: outside the index {self.scope}; a store source reads"
                                   " only its own keys")
        return unquote(path[len(self.scope):]) + page

    def _get(self, url: str, limit: int, page: str = "") -> bytes | None:
        key = self._key(url, page)
        try:
            info = self.store.head(key)
            if info is not None and info.size > limit:
                raise TooLargeError(f"{url}{page}: {info.size} bytes, over the cap of {limit}; not read")
            data = None if info is None else self.store.get(key)
        except UnsafePathError as exc:
            raise LinkRefusedError(f"{url}{page}: refused, not read: {exc}") from exc
        except FetchError:
            raise
        except KilnError as exc:  # a bad key, a refused or failed read: a problem of this URL
            raise FetchError(f"{url}{page}: {exc}") from exc
        if data is not None and len(data) > limit:
            raise TooLargeError(f"{url}{page}: {len(data)} bytes, over the cap of {limit}")
        return data

    def page(self, url: str) -> Page:
        html = self._get(url, self.limits.max_page_bytes, HTML_PAGE)
        if html is None:
            raise FetchError(f"{url}: no {HTML_PAGE} in {self.store.url}")
        data = self._get(url, self.limits.max_page_bytes, JSON_PAGE)
        json_url = url + JSON_PAGE
        return Page(
            url, html, None if data is None else _parse_json(data, json_url), None if data is None else json_url
        )

    def download(self, url: str, sink: Sink, limit: int) -> None:
        data = self._get(url, limit)
        if data is None:
            raise FetchError(f"{url}: not found in {self.store.url}")
        sink.write(data)


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


_COMMIT_INDEX = re.compile(r"(?P<variant>.*/)commits/[0-9a-f]{12}/simple/\Z")


def commit_index_scope(root: str) -> str:
    """What a store source of ``root`` may read: a per-commit index (``<variant>/commits/<commit12>/simple/``,
    see :mod:`kiln.release.publish.protocol`) links its files in ``<variant>/simple/``, so its variant's directory;
    any other index, itself."""
    found = _COMMIT_INDEX.match(root)
    return found.group("variant") if found else root


def open_source(url: str, timeout: float, settings: StoreSettings | None = None, allowed: Sequence[str] = (),
                limits: FetchLimits | None = None) -> IndexSource:
    """The source for an index URL (normalised to end in "/"); InvalidInputError for other schemes.

    ``allowed``: the extra indexes' URLs, whose servers an http(s) index may also link.
    """
    root = url if url.endswith("/") else url + "/"
    scheme = urlsplit(root).scheme
    if scheme in ("http", "https"):
        return HttpSource(root, timeout, allowed, limits)
    if scheme == "file":
        directory, scope = local_path(root), commit_index_scope(root)
        if not directory.is_dir():
            raise InvalidInputError(f"{url}: {directory} is not a directory")
        # An index under verification is never Kiln's word, whoever may write it: every hash it states is checked.
        return StoreSource(LocalStore(local_path(scope), public=True), root, limits, scope)
    if is_remote(root):
        settings = settings or StoreSettings()
        # Its own keys only (a per-commit index's: its variant's directory, where its links lead); the verifier
        # serves this store to pip from the scope, and pip reads the index at its path below it.
        scope = commit_index_scope(root)
        store = open_store(scope.rstrip("/"), root=Path("."), region=settings.region, endpoint=settings.endpoint,
                           expected_owner=settings.expected_owner, session=settings.session)
        log.info("reading %s through %s", root, store.url)
        return StoreSource(store, root, limits, scope)
    raise InvalidInputError(f"index URL {url!r}: scheme must be http://, https://, file:// or s3://")
