"""An independent reader of index pages (html.parser + json), for conformance checks.

It shares no code with kiln.release.index.render on purpose: a bug in the generator must
not be mirrored by the reader that checks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import unquote, urldefrag


@dataclass
class Anchor:
    text: str
    href: str
    attrs: dict[str, str | None] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return urldefrag(self.href)[0]

    @property
    def fragment(self) -> str:
        return urldefrag(self.href)[1]

    @property
    def decoded_name(self) -> str:
        return unquote(self.url.rsplit("/", 1)[-1])


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: list[Anchor] = []
        self.meta: dict[str, str | None] = {}
        self._open: Anchor | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "a":
            self._open = Anchor("", values.get("href") or "", values)
        elif tag == "meta" and values.get("name"):
            self.meta[values["name"]] = values.get("content")  # type: ignore[index]

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open.text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._open is not None:
            self.anchors.append(self._open)
            self._open = None


def parse_html(data: bytes) -> tuple[dict[str, str | None], list[Anchor]]:
    parser = _Anchors()
    parser.feed(data.decode("utf-8"))
    parser.close()
    return parser.meta, parser.anchors


def parse_json(data: bytes) -> dict:
    return json.loads(data)
