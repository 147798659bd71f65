"""The two forms of an index page as :mod:`kiln.release.read.verify` reads them: every file a page lists.

:func:`html_files` reads the PEP 503 HTML form, :func:`json_files` the PEP 691
JSON form, each into :class:`FileRef` records by filename; :func:`compare_forms`
names every way the two forms disagree. What is wrong with a page is appended
to the caller's list of problems, never raised: a report lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any
from urllib.parse import unquote, urldefrag, urlsplit

from kiln.release.read.fetch import Page, join


@dataclass(frozen=True)
class FileRef:
    """One file as one form of a page describes it."""

    form: str  # "HTML" or "JSON"
    url: str  # absolute, without the fragment
    sha256: str | None
    size: int | None  # only the JSON form states it
    metadata: str | None  # the advertised sidecar: "sha256=<hex>", "true" (no hash), or None
    yanked: bool


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.anchors.append(dict(attrs))


def anchors(page: Page) -> list[dict[str, str | None]]:
    parser = _Anchors()
    parser.feed(page.html.decode("utf-8", errors="replace"))
    return parser.anchors


def filename_of(href: str) -> str:
    return unquote(urlsplit(href).path.rsplit("/", 1)[-1])


def html_files(page: Page, problems: list[str]) -> dict[str, FileRef]:
    files = {}
    for anchor in anchors(page):
        href, fragment = urldefrag(anchor.get("href") or "")
        if "+" in href:
            problems.append(f"{page.url}: link {href!r} has a raw '+' (must be %2B)")
        name = filename_of(href)
        core, dist_info = anchor.get("data-core-metadata"), anchor.get("data-dist-info-metadata")
        if core and dist_info and core != dist_info:  # PEP 714: one sidecar, two names for old and new clients
            problems.append(f"{page.url}: {name}: data-core-metadata {core!r} "
                                   f"differs from data-dist-info-metadata {dist_info!r}")
        metadata = core or dist_info
        sha256 = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        files[name] = FileRef("HTML", join(page.url, href), sha256, None, metadata, "data-yanked" in anchor)
    return files


def _json_metadata(entry: dict[str, Any]) -> str | None:
    value = entry.get("core-metadata", entry.get("dist-info-metadata"))
    if isinstance(value, dict):
        return f"sha256={value.get('sha256')}"
    return "true" if value is True else None


def json_files(page: Page, problems: list[str]) -> dict[str, FileRef]:
    files = {}
    for entry in page.json.get("files", []) if isinstance(page.json, dict) else []:
        try:
            name, url = entry["filename"], entry["url"]
            sha256 = entry["hashes"].get("sha256")
        except (KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{page.json_url}: a file entry lacks {exc} (PEP 691 needs filename, url, hashes)")
            continue
        if "+" in urlsplit(url).path:
            problems.append(f"{page.json_url}: {name}: url {url!r} has a raw '+' (must be %2B)")
        files[name] = FileRef("JSON", join(page.json_url or page.url, urldefrag(url)[0]), sha256, entry.get("size"),
                              _json_metadata(entry), bool(entry.get("yanked")))
    return files


def compare_forms(page: Page, html: dict[str, FileRef], data: dict[str, FileRef], problems: list[str]) -> None:
    if sorted(html) != sorted(data):
        problems.append(f"{page.url}: HTML lists {sorted(html)}, JSON ({page.json_url}) lists {sorted(data)}")
    for name in sorted(set(html) & set(data)):
        a, b = html[name], data[name]
        for what, left, right in (("sha256", a.sha256, b.sha256), ("metadata sidecar", a.metadata, b.metadata),
                                  ("yanked", a.yanked, b.yanked), ("url", a.url, b.url)):
            if left != right:
                problems.append(f"{page.url}: {name}: HTML says {what} {left}, JSON says {right}")
