"""An index checker independent of Kiln's own code, for tests.

It parses every HTML page under a local index with the standard library's
HTML parser and checks each link: the file exists and its SHA-256 is the one
in the ``#sha256=`` fragment. It shares nothing with ``release/`` on purpose,
so a bug there cannot hide itself.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links.append(dict(attrs))


@dataclass
class IndexReport:
    pages: int = 0
    files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_local_index(root: Path) -> IndexReport:
    """Check every link on every ``*.html`` page below ``root``."""
    report = IndexReport()
    base = root.resolve()
    for page in sorted(base.rglob("*.html")):
        report.pages += 1
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        page_url = page.as_uri()
        for attrs in parser.links:
            href = attrs.get("href") or ""
            url, fragment = urldefrag(urljoin(page_url, href))
            target = Path(unquote(urlparse(url).path))
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                report.problems.append(f"{page.relative_to(base)}: link {href!r} does not resolve")
                continue
            if target.suffix == ".html":
                continue
            if not fragment.startswith("sha256="):
                report.problems.append(f"{page.relative_to(base)}: file link {href!r} has no #sha256=")
                continue
            if _sha256(target) != fragment.removeprefix("sha256="):
                report.problems.append(f"{page.relative_to(base)}: {href!r} hash does not match the file")
            report.files.append(target)
            for key in ("data-core-metadata", "data-dist-info-metadata"):
                value = attrs.get(key)
                if value and value.startswith("sha256="):
                    sidecar = Path(str(target) + ".metadata")
                    if not sidecar.exists() or _sha256(sidecar) != value.removeprefix("sha256="):
                        report.problems.append(f"{page.relative_to(base)}: {key} of {href!r} does not match its sidecar")
    return report
