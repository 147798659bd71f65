"""The written pages of the docs site read in short paragraphs: no paragraph or list item is a wall.

Each page is rendered with the site's own Markdown extensions, and every paragraph and every list item's own
text (its nested lists are items of their own) is counted in words; code blocks and tables are not prose. The
generated reference pages are checked by their own tests.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_WORDS = 120  # the anchors' READMEs average 20-47 words a paragraph; a long one here still fits a screen
PAGES = sorted(p for p in DOCS.rglob("*.md") if "reference" not in p.relative_to(DOCS).parts)
EXTENSIONS = ["admonition", "attr_list", "tables", "toc", "pymdownx.superfences"]  # mkdocs.yml's markdown_extensions


class _Prose(HTMLParser):
    """The words of each ``<p>``, and of each ``<li>`` outside its own paragraphs and nested lists."""

    BLOCKS = ("p", "li")
    SKIPPED = ("pre", "table")

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[list[str]] = []
        self.skipping = 0
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIPPED:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.stack.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIPPED:
            self.skipping -= 1
        elif tag in self.BLOCKS and self.stack:
            text = " ".join(self.stack.pop()).split()
            if text:
                self.found.append(" ".join(text))

    def handle_data(self, data: str) -> None:
        if self.stack and not self.skipping:
            self.stack[-1].append(data)


def paragraphs(markdown_text: str) -> list[str]:
    markdown = pytest.importorskip("markdown")  # mkdocs's, installed with it (pip install -e '.[test]')
    pytest.importorskip("pymdownx")
    parser = _Prose()
    parser.feed(markdown.markdown(markdown_text, extensions=EXTENSIONS))
    return parser.found


def test_a_wall_of_text_is_found_and_a_list_item_counts_apart_from_its_nested_list():
    wall = " ".join(["word"] * 130)
    assert [len(p.split()) for p in paragraphs(f"{wall}\n\n- short item\n    - nested item\n")] == [130, 2, 2]
    assert paragraphs("```text\n" + wall + "\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES])
def test_no_paragraph_of_a_written_page_is_a_wall(page):
    long = [f"{len(p.split())} words: {p[:80]}…" for p in paragraphs(page.read_text(encoding="utf-8"))
            if len(p.split()) > MAX_WORDS]
    assert long == [], f"split these into short paragraphs or a list (house style: ../shared/STYLE.md): {long}"
