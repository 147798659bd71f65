"""What users download through a target's public URL is what the index says.

A publish target may name a ``public_url`` (``[publish.targets.<name>]``): a
CDN or web server in front of the store, where users really download from.
Kiln's keys are immutable, and its pages change only by compare-and-swap, but
a cache in front can still serve old bytes — PyTorch lost nightly hashes to a
CDN serving stale files under a re-used name. :func:`check_public` downloads
each file and page through the public URL and compares its SHA-256 with what
the index says: for a file, the sha256 its page lists (a sidecar's, the
``data-dist-info-metadata`` hash); for a page, the bytes the store holds (what
Kiln just wrote). Each one that differs is a problem naming it, its URL and
both hashes.

Two ways in, one check:

* :func:`published_expectations`: after a publish, every NEW file of the plan
  (its wheel and sidecar) and every page it changed, by store key (the public
  URL stands for the store's root).
* :func:`index_expectations` (``kiln verify URL --public-url PUBLIC``): every
  page (HTML and JSON form, by file name) and file of the index at ``URL``,
  each by its path below that index (``PUBLIC`` stands for ``URL``).

Pages are read by their stored names (``index.html``, ``index.json``), as a
CDN in front of a bucket maps a path to a key; a page whose JSON form the
origin does not hold is checked by its HTML alone. Downloads stream, capped
(:class:`~kiln.release.read.fetch.FetchLimits`), from the public URL's own origin
only.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import quote, unquote, urljoin, urlsplit

from packaging.utils import canonicalize_name

from kiln.core.errors import FetchError, InvalidInputError
from kiln.core.fsutil import sha256_bytes
from kiln.core.objects import Store
from kiln.release.index.render import HTML_PAGE, JSON_PAGE
from kiln.release.publish.plan import Plan
from kiln.release.read.fetch import FetchLimits, HttpSource, IndexSource, StoreSettings, file_bytes, join, open_source
from kiln.release.read.pageforms import FileRef, anchors, filename_of, html_files, json_files

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
PAGE_POLL_S = 15.0  # how often a page a cache still serves old is fetched again, within its grace
MAX_LISTED = 50
Kind = Literal["file", "page"]


@dataclass(frozen=True)
class Expected:
    """One object as the index says it is: its path below the public root (decoded, as a store key) and sha256."""

    path: str
    sha256: str
    kind: Kind


@dataclass
class PublicReport:
    public_url: str
    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        state = "OK" if self.ok else "FAILED"
        lines = [f"{state}: through {self.public_url}: {self.checked} files and pages, {len(self.problems)} differ"
                 " from the index or do not resolve"]
        lines += [f"  problem: {p}" for p in self.problems[:MAX_LISTED]]
        return "\n".join(lines)


class _Hashing:
    def __init__(self) -> None:
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return len(data)


def public_root(url: str) -> str:
    """``url`` as the root of a public URL (http or https, ending in "/"); InvalidInputError naming it otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidInputError(f"public URL {url!r} must be an http:// or https:// URL (the CDN or web server in"
                                " front of the store)")
    return url if url.endswith("/") else url + "/"


def _stale_hint(kind: Kind) -> str:
    if kind == "file":
        return ("a file's key is never re-used, so a cache in front serves bytes Kiln never wrote there: purge it, and"
                " check what else the cache or its origin maps to this path")
    return ("a page changes on every publish: a cache in front serves an old copy (Cache-Control allows a release's"
            " pages 5 minutes, a nightly's none); purge it, or run kiln verify --public-url again once it expired")


def _check_one(source: HttpSource, root: str, item: Expected) -> tuple[str | None, bool]:
    """(the problem with ``item`` through the public URL or None, whether it was served at all)."""
    url = urljoin(root, quote(item.path))
    sink = _Hashing()
    cap = source.limits.max_file_bytes if item.kind == "file" else source.limits.max_page_bytes
    try:
        source.download(url, sink, cap)
    except FetchError as exc:
        return f"{item.path}: the {item.kind} is not served at {url}: {exc}", False
    actual = sink.digest.hexdigest()
    if actual == item.sha256:
        return None, True
    return (f"{item.path}: {url} serves other bytes than the index says (sha256 {actual}, {sink.size} bytes; the"
            f" index: sha256 {item.sha256}): {_stale_hint(item.kind)}"), True


def check_public(public_url: str, expected: Sequence[Expected], timeout: float = DEFAULT_TIMEOUT_S,
                 limits: FetchLimits | None = None, page_grace_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                 ) -> PublicReport:
    """Download each of ``expected`` through ``public_url``; each whose bytes differ (or that is not served) is a
    problem naming it.

    ``page_grace_s``: how long a cache in front may keep serving a page's previous bytes (the pages'
    ``max-age``: none on a nightly channel, 5 minutes on releases). A page that differs is fetched again
    every :data:`PAGE_POLL_S` until that long has passed, and is a problem only then; a file never waits (its
    key is never re-used: other bytes there are a fault, not an age).
    """
    root = public_root(public_url)
    source = HttpSource(root, timeout, limits=limits)
    report = PublicReport(root)
    waiting: dict[Expected, str] = {}
    for item in expected:
        problem, served = _check_one(source, root, item)
        report.checked += int(served)
        if problem is not None and served and item.kind == "page" and page_grace_s > 0:
            waiting[item] = problem
        elif problem is not None:
            report.problems.append(problem)
    deadline = clock() + page_grace_s
    while waiting and clock() < deadline:
        log.info("%d pages through %s are older than the index; looking again (a cache may keep them up to %g s)",
                 len(waiting), root, page_grace_s)
        sleep(min(PAGE_POLL_S, max(0.0, deadline - clock())))
        for item in list(waiting):
            problem, _ = _check_one(source, root, item)
            if problem is None:
                del waiting[item]
            else:
                waiting[item] = problem
    report.problems += waiting.values()
    log.info("checked %d files and pages through %s: %d problems", report.checked, root, len(report.problems))
    return report


def published_expectations(store: Store, plan: Plan) -> list[Expected]:
    """What a publish added (wheels and their sidecars) and the pages it changed, by store key: what the public
    URL of the store's root must serve now. Files already present before are not new: not listed."""
    expected: list[Expected] = []
    for result in sorted(plan.results, key=lambda r: r.upload.key):
        if result.outcome != "added":
            continue
        dist = result.upload.dist
        expected.append(Expected(result.upload.key, dist.sha256, "file"))
        if dist.metadata_sha256:
            expected.append(Expected(result.upload.sidecar_key, dist.metadata_sha256, "file"))
    for key in sorted(plan.pages):
        data = store.get(key)  # the store's copy now (a later publisher's page is as good as this one's)
        if data is not None:
            expected.append(Expected(key, sha256_bytes(data), "page"))
    return expected


def _relative(url: str, root: str) -> str:
    """The decoded path of ``url`` below ``root`` (``../`` where a per-commit index links its channel's files)."""
    return unquote(posixpath.relpath(urlsplit(url).path, urlsplit(root).path))


def _page_forms(source: IndexSource, page_url: str, root: str) -> list[Expected]:
    """Both stored forms of a page as the origin holds them (the JSON form only where it exists)."""
    found = []
    for name in (HTML_PAGE, JSON_PAGE):
        try:
            data = file_bytes(source, page_url + name, source.limits.max_page_bytes)
        except FetchError as exc:
            if name == JSON_PAGE and exc.status in (None, 403, 404, 410):
                continue
            raise
        found.append(Expected(_relative(page_url + name, root), sha256_bytes(data), "page"))
    return found


def _files(refs: dict[str, FileRef], root: str) -> list[Expected]:
    found = []
    for ref in refs.values():
        if ref.sha256:
            found.append(Expected(_relative(ref.url, root), ref.sha256, "file"))
        if ref.metadata and ref.metadata.startswith("sha256="):
            found.append(Expected(_relative(ref.url + ".metadata", root), ref.metadata.removeprefix("sha256="),
                                  "file"))
    return found


def index_expectations(url: str, timeout: float = DEFAULT_TIMEOUT_S, settings: StoreSettings | None = None,
                       limits: FetchLimits | None = None) -> list[Expected]:
    """Every page and file of the index at ``url`` as its origin holds them, by path below ``url``."""
    source = open_source(url, timeout, settings, limits=limits)
    root = source.root
    problems: list[str] = []
    top = source.page(root)
    names = {canonicalize_name(filename_of((a.get("href") or "").rstrip("/"))) for a in anchors(top) if a.get("href")}
    if isinstance(top.json, dict):
        names |= {canonicalize_name(p["name"]) for p in top.json.get("projects", [])
                  if isinstance(p, dict) and isinstance(p.get("name"), str)}
    expected = _page_forms(source, root, root)
    for name in sorted(names):
        page_url = join(root, quote(name) + "/")
        expected += _page_forms(source, page_url, root)
        page = source.page(page_url)
        refs = {**html_files(page, problems), **(json_files(page, problems) if page.json is not None else {})}
        expected += _files(refs, root)
    return sorted(set(expected), key=lambda e: (e.kind, e.path))


def verify_public(url: str, public_url: str, timeout: float = DEFAULT_TIMEOUT_S,
                  settings: StoreSettings | None = None, limits: FetchLimits | None = None) -> PublicReport:
    """``kiln verify URL --public-url PUBLIC``: every page and file of the index at ``url`` through ``public_url``."""
    public_root(public_url)  # refused before anything is fetched
    return check_public(public_url, index_expectations(url, timeout, settings, limits), timeout, limits)


__all__ = ["Expected", "PublicReport", "check_public", "index_expectations", "public_root", "published_expectations",
           "verify_public"]
