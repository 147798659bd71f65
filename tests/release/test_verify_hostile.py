"""``kiln verify`` against hostile indexes (issue 33): it stays on the index, caps every download, checks
RECORD, never reads through a link out of a file:// index, and never imports from the caller's directory.

The hostile index is a real HTTP server on loopback (``http.server`` in a thread); the other hosts and
ports it links are real listening sockets, checked afterwards for connections that should never come.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kiln.core.wheels import read_wheel
from kiln.release.cli import EXIT_OK, index_command
from kiln.release.index.render import JSON_TYPE, generate
from kiln.release.read.fetch import FetchLimits
from kiln.release.read.verify import verify_index
from tests.helpers.wheelkit import make_wheel, rewrite_members

MIB = 1 << 20
ENDLESS_MIB = 400  # what the oversized bodies would send if nobody stopped reading
MAX_FILE = 4 * MIB
SENT_AT_MOST = 64 * MIB  # the cap plus what loopback socket buffers absorb after the reader stops
DEADLINE_S = 60.0
ZERO_HASH = "0" * 64


def _listener(host: str) -> socket.socket:
    """A socket that listens and never accepts: a connection to it stays in its backlog, for the test to find."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(8)
    return sock


def _was_connected(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


class _Hostile(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, other_host: str, other_port: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.sent: dict[str, int] = {}
        self.finished: set[str] = set()
        base = "/simple/evil/"
        # (filename, href, declared size in the JSON form or None)
        self.files = [
            ("hostname", "file:///etc/hostname", None),
            ("evil-1.0-py3-none-any.whl", f"http://{other_host}/evil-1.0-py3-none-any.whl", None),
            ("evil-1.1-py3-none-any.whl", f"http://{other_port}/evil-1.1-py3-none-any.whl", None),
            ("evil-2.0-py3-none-any.whl", base + "evil-2.0-py3-none-any.whl", 1000),  # body endless
            ("evil-3.0-py3-none-any.whl", base + "evil-3.0-py3-none-any.whl", None),  # endless, no size given
            ("evil-4.0-py3-none-any.whl", base + "evil-4.0-py3-none-any.whl", 1000),  # announces 400 MiB
            ("evil-5.0-py3-none-any.whl", base + "evil-5.0-py3-none-any.whl", None),  # redirects off the index
        ]
        self.redirect_to = f"http://{other_host}/redirected.whl"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple/"


class _Handler(BaseHTTPRequestHandler):
    server: _Hostile

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _page(self, html: str, data: object) -> None:
        if JSON_TYPE in (self.headers.get("Accept") or ""):
            self._send(json.dumps(data).encode(), JSON_TYPE)
        else:
            self._send(html.encode(), "text/html")

    def _endless(self, announce: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if announce:
            self.send_header("Content-Length", str(ENDLESS_MIB * MIB))
        self.end_headers()
        block = b"\0" * MIB
        try:
            for _ in range(ENDLESS_MIB):
                self.wfile.write(block)
                self.server.sent[self.path] = self.server.sent.get(self.path, 0) + len(block)
        except OSError:
            pass  # the reader stopped: what this test wants
        finally:
            self.server.finished.add(self.path)

    def do_GET(self) -> None:
        files = self.server.files
        if self.path == "/simple/":
            self._page('<a href="evil/">evil</a>', {"meta": {"api-version": "1.0"}, "projects": [{"name": "evil"}]})
        elif self.path == "/simple/evil/":
            links = "".join(f'<a href="{href}#sha256={ZERO_HASH}">{name}</a>' for name, href, _ in files)
            entries = [{"filename": name, "url": href, "hashes": {"sha256": ZERO_HASH},
                        **({"size": size} if size is not None else {})} for name, href, size in files]
            self._page(links, {"meta": {"api-version": "1.0"}, "name": "evil", "files": entries})
        elif self.path.endswith(("evil-2.0-py3-none-any.whl", "evil-3.0-py3-none-any.whl")):
            self._endless(announce=False)
        elif self.path.endswith("evil-4.0-py3-none-any.whl"):
            self._endless(announce=True)
        elif self.path.endswith("evil-5.0-py3-none-any.whl"):
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@pytest.fixture
def hostile() -> Iterator[tuple[_Hostile, socket.socket, socket.socket]]:
    other_host, other_port = _listener("127.0.0.2"), _listener("127.0.0.1")
    server = _Hostile(f"127.0.0.2:{other_host.getsockname()[1]}", f"127.0.0.1:{other_port.getsockname()[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, other_host, other_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)
        other_host.close()
        other_port.close()


def _wait_finished(server: _Hostile, paths: list[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not set(paths) <= server.finished:
        assert time.monotonic() < deadline, f"the server still sends {set(paths) - server.finished}"
        time.sleep(0.05)  # poll interval of a condition checked each round


def test_a_hostile_index_gets_nothing_fetched_beyond_its_cap_and_every_refused_link_is_named(hostile) -> None:
    server, other_host, other_port = hostile
    started = time.monotonic()
    report = verify_index(server.url, install=False, limits=FetchLimits(max_file_bytes=MAX_FILE))
    assert time.monotonic() - started < DEADLINE_S
    summary = report.summary()
    assert not report.ok
    links = {name: href if "://" in href else f"http://127.0.0.1:{server.server_address[1]}{href}"
             for name, href, _ in server.files}
    assert set(report.refused) == set(links.values()), summary
    for url in links.values():
        assert f"refused: {url}" in summary, summary
    assert not _was_connected(other_host) and not _was_connected(other_port)
    endless = [f"/simple/evil/evil-{v}-py3-none-any.whl" for v in ("2.0", "3.0", "4.0")]
    _wait_finished(server, endless)
    assert all(server.sent.get(path, 0) < SENT_AT_MOST for path in endless), server.sent
    if Path("/etc/hostname").is_file():
        assert hashlib.sha256(Path("/etc/hostname").read_bytes()).hexdigest() not in summary


def _index_by_hand(tmp_path: Path, wheel: Path) -> Path:
    """An index of ``wheel`` written without ``kiln index`` (which refuses a wheel whose RECORD lies)."""
    dist, metadata = read_wheel(wheel, upload_time=0)
    out = tmp_path / "index"
    for rel, data in generate([dist]).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    shutil.copy(wheel, out / dist.project / dist.filename)
    (out / dist.project / f"{dist.filename}.metadata").write_bytes(metadata)
    return out


def test_verify_reports_a_wheel_whose_record_lies(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "wheels", "liar", "1.0")
    rewrite_members(wheel, {"liar/__init__.py": b"import os  # not what RECORD says\n"})
    report = verify_index(_index_by_hand(tmp_path, wheel).as_uri(), install=False)
    assert not report.ok
    assert any("RECORD says liar/__init__.py" in p for p in report.problems), report.summary()


def test_verify_of_a_file_index_refuses_a_link_out_of_its_directory(tmp_path: Path) -> None:
    make_wheel(tmp_path / "wheels", "demo", "1.0")
    out = tmp_path / "out"
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_OK
    wheel = out / "demo" / "demo-1.0-py3-none-any.whl"
    outside = tmp_path / "outside.whl"
    wheel.rename(outside)
    os.symlink(outside, wheel)
    report = verify_index(out.as_uri(), install=False)
    assert not report.ok and report.refused == [wheel.as_uri()], report.summary()
    assert "outside the store" in report.summary()


_PLANT = "import pathlib; pathlib.Path({marker!r}).write_text(__name__); raise SystemExit('planted {name} ran')\n"


@pytest.mark.slow
def test_verify_never_imports_a_module_planted_in_the_callers_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(tmp_path / "wheels", "plantme", "1.0")
    out = tmp_path / "out"
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_OK
    caller = tmp_path / "caller"
    caller.mkdir()
    marker = tmp_path / "planted-module-ran"
    for name in ("plantme", "venv", "sysconfig", "importlib"):  # the wheel's package and modules the helpers use
        (caller / f"{name}.py").write_text(_PLANT.format(marker=str(marker), name=name))
    monkeypatch.chdir(caller)
    report = verify_index(out.as_uri())
    assert report.ok, report.summary()
    assert report.installs and all(state == "ok" for state in report.installs.values()), report.installs
    assert not marker.exists(), marker.read_text()
