"""Serve a store (a directory or an S3 prefix) over HTTP the way a CDN function would.

``…/`` maps to ``index.json`` when the client's ``Accept`` prefers
``application/vnd.pypi.simple.v1+json`` (PEP 691 negotiation; pip and uv
ask for it) and to ``index.html`` otherwise; ``…/project`` without the slash
redirects to ``…/project/``. Paths are percent-decoded exactly once and
``+`` stays a ``+`` — the decoding S3 website endpoints get wrong.

The server binds 127.0.0.1 on an ephemeral port (port 0, read back after
binding) so parallel tests never race for a port.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import unquote, urlsplit

from kiln.core.errors import InvalidInputError, KilnError
from kiln.core.store import Store, check_key
from kiln.release.index.render import HTML_PAGE, HTML_TYPE, JSON_PAGE, JSON_TYPE

log = logging.getLogger(__name__)

_HTML_TYPES = ("text/html", "application/vnd.pypi.simple.v1+html", "application/vnd.pypi.simple.latest+html")
_JSON_TYPES = (JSON_TYPE, "application/vnd.pypi.simple.latest+json")
_BY_SUFFIX = {".html": HTML_TYPE, ".json": JSON_TYPE, ".whl": "application/octet-stream",
              ".metadata": "text/plain; charset=utf-8", ".gz": "application/gzip", ".zip": "application/zip"}


def wants_json(accept: str | None) -> bool:
    """PEP 691 content negotiation: JSON when its quality beats every HTML type's."""
    best_json = best_html = 0.0
    for item in (accept or "").split(","):
        media, *params = [p.strip() for p in item.split(";")]
        quality = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    quality = float(param[2:])
                except ValueError:
                    quality = 0.0
        if media in _JSON_TYPES:
            best_json = max(best_json, quality)
        elif media in _HTML_TYPES or media in ("*/*", "text/*"):
            best_html = max(best_html, quality)
    return best_json > 0 and best_json >= best_html


class _Handler(BaseHTTPRequestHandler):
    store: Store
    prefix: str

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        try:
            key, content_type, data = self._resolve(path)
        except InvalidInputError:
            self._send(400, "text/plain", b"bad path\n", body)
            return
        except KilnError as exc:
            log.warning("serving %s failed: %s", path, exc)
            self._send(502, "text/plain", f"{exc}\n".encode(), body)
            return
        if data is None and key is not None:
            self.send_response(301)
            self.send_header("Location", path + "/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif data is None:
            self._send(404, "text/plain", b"not found\n", body)
        else:
            self._send(200, content_type, data, body)

    def _resolve(self, path: str) -> tuple[str | None, str, bytes | None]:
        """(key, content type, bytes); bytes None with a key means "redirect to key/"."""
        rel = path.lstrip("/")
        base = self.prefix + rel
        if path.endswith("/") or not rel:
            page, ctype = (JSON_PAGE, JSON_TYPE) if wants_json(self.headers.get("Accept")) else (HTML_PAGE, HTML_TYPE)
            return None, ctype, self.store.get(check_key(base + page))
        data = self.store.get(check_key(base.rstrip("/")))
        if data is None:
            if self.store.get(check_key(base + "/" + HTML_PAGE)) is not None:
                return base, "", None
            return None, "", None
        suffix = "." + rel.rsplit(".", 1)[-1] if "." in rel else ""
        return base, _BY_SUFFIX.get(suffix, "application/octet-stream"), data

    def _send(self, status: int, content_type: str, data: bytes, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Vary", "Accept")
        self.end_headers()
        if body:
            self.wfile.write(data)


class IndexServer:
    """``with IndexServer(store, "nightly/cu130/") as server: server.url`` — serve until the block ends."""

    def __init__(self, store: Store, prefix: str = "") -> None:
        prefix = prefix.strip("/")
        self._store = store
        handler = type("Handler", (_Handler,), {"store": store, "prefix": prefix + "/" if prefix else ""})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{port}/"  # bound to loopback above
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kiln-serve", daemon=True)

    def __enter__(self) -> IndexServer:
        self._thread.start()
        log.info("serving %s at %s", self._store.url, self.url)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
