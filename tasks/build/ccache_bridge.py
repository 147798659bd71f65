"""The compile cache's shared tier in a remote store: a ccache storage helper that Kiln runs, on a Unix socket.

A sandboxed compile has no network and no credentials, so ccache cannot reach an ``s3://`` store itself. Kiln
serves ccache's storage helper protocol (version 1, ``doc/remote_storage_helper_spec.md`` in ccache's sources:
a greeting, then ``get``/``put``/``remove`` requests of binary keys and values) on a socket in a private folder,
from a thread of the build step's own process, with the store opened under the build role's credentials.
ccache reaches it as ``crsh:<socket>``: a filesystem socket crosses the compile's network namespace, and the
credentials never enter the sandbox.

The store is used as the unit cache's shared tier uses it (:mod:`kiln.tasks.build.cache_remote`):

- every value is written create-only under its key (``If-None-Match: *`` on S3): a second writer of a key keeps
  the first's bytes. ccache checksums each entry it reads, so a torn, corrupted or forged value is a miss and a
  compile, never a wrong object; nothing is ever removed through the bridge;
- a store that does not answer turns the bridge off for the rest of the build with one warning (every request is
  then a miss, answered at once), and a store that refuses a write (a read-only role) keeps its reads;
- each connection has a deadline per request (:data:`REQUEST_TIMEOUT_S`), and the store's calls have botocore's
  bounded timeouts and retries.

The bridge is a daemon thread (it cannot outlive the build step's process) and stops when the build's compile
cache is dropped, on :meth:`Bridge.close`, or after :data:`IDLE_TIMEOUT_S` without a request.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.core.errors import AccessDeniedError, IntegrityError, KilnError
from kiln.core.objects import Store

_log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
CAPABILITIES = b"\x00"  # get/put/remove
REQUEST_TIMEOUT_S = 60.0  # one request's bytes, and a connection's wait for its next request
IDLE_TIMEOUT_S = 3600.0  # a build step whose compiles stopped asking: the bridge goes
_GET, _PUT, _REMOVE, _STOP = 0, 1, 2, 3
_OK, _NOOP, _ERR = b"\x00", b"\x01", b"\x02"
_U64 = struct.Struct("=Q")  # host byte order: both ends are on this host
_CONTENT_TYPE = "application/octet-stream"
_CACHE_CONTROL = "public, max-age=31536000, immutable"
MAX_VALUE = 4 << 30  # a compile's object file; a longer length is a broken client, not an object


@dataclass
class BridgeStats:
    """What the bridge did in one build: values served, missed and written, and why it stopped using the store."""

    hits: int = 0
    misses: int = 0
    written: int = 0
    kept: int = 0  # writes of a key another builder wrote first, with other bytes: theirs stays
    unreachable: str = ""
    read_only: bool = False


@dataclass
class Bridge:
    """The helper's server for ``store`` under ``prefix``; ``socket_path`` is what ccache connects to."""

    store: Store
    prefix: str
    read_only: bool = False
    stats: BridgeStats = field(default_factory=BridgeStats)
    socket_path: Path = field(init=False)
    _server: socketserver.ThreadingUnixStreamServer | None = field(default=None, init=False, repr=False)
    _folder: Path | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last: float = field(default_factory=time.monotonic, repr=False)
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self.prefix = self.prefix.strip("/")
        self.stats.read_only = self.read_only

    def start(self) -> Bridge:
        """Listen on a socket in a new owner-only folder (short: a socket path has at most 107 bytes)."""
        self._folder = Path(tempfile.mkdtemp(prefix="kiln-ccache-"))
        self.socket_path = self._folder / "helper.sock"
        old = os.umask(0o077)
        try:
            self._server = _Server(str(self.socket_path), _Handler, bridge=self)
        finally:
            os.umask(old)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                         name="kiln-ccache-bridge", daemon=True).start()
        threading.Thread(target=self._watch_idle, name="kiln-ccache-bridge-idle", daemon=True).start()
        _log.info("compile cache: the shared tier %s/%s is served to ccache on %s", getattr(self.store, "url", ""),
                  self.prefix, self.socket_path)
        return self

    def close(self) -> None:
        """Stop serving and remove the socket's folder; safe to call twice."""
        self._stopped.set()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _watch_idle(self) -> None:
        while not self._stopped.wait(min(IDLE_TIMEOUT_S / 4, 30.0)):
            if time.monotonic() - self._last > IDLE_TIMEOUT_S:
                _log.info("compile cache: the shared tier's bridge had no request for %.0f s; it stops", IDLE_TIMEOUT_S)
                self.close()
                return

    def _key(self, key: bytes) -> str:
        return f"{self.prefix}/{key.hex()}"

    def _give_up(self, exc: KilnError, doing: str) -> None:
        with self._lock:
            first = not self.stats.unreachable
            self.stats.unreachable = f"{doing}: {exc}"
        if first:
            _log.warning("compile cache: the shared tier at %s did not answer (%s: %s); this build's compiles go on "
                         "with their local cache only", getattr(self.store, "url", self.prefix), doing, exc)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self.stats, what, getattr(self.stats, what) + 1)

    def get(self, key: bytes) -> bytes | None:
        """The stored value (ccache checks it), or None: a miss, or a store that does not answer."""
        self._last = time.monotonic()
        if self.stats.unreachable:
            return None
        try:
            data = self.store.get(self._key(key))
        except KilnError as exc:
            self._give_up(exc, f"reading {key.hex()[:16]}")
            return None
        self._count("hits" if data is not None else "misses")
        return data

    def put(self, key: bytes, value: bytes) -> bool:
        """Write ``value`` create-only; whether the store now holds it (or the same bytes already)."""
        self._last = time.monotonic()
        if self.read_only or self.stats.unreachable:
            return False
        try:
            self.store.put_immutable(self._key(key), value, _CONTENT_TYPE, _CACHE_CONTROL)
        except AccessDeniedError as exc:
            _log.warning("compile cache: the shared tier refused a write (%s); this build only reads it", exc)
            self.read_only = self.stats.read_only = True
            return False
        except IntegrityError:
            self._count("kept")  # another builder's bytes under this key stay; ccache checks them when read
            return False
        except KilnError as exc:
            self._give_up(exc, f"writing {key.hex()[:16]}")
            return False
        self._count("written")
        return True


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler], *, bridge: Bridge) -> None:
        self.bridge = bridge
        super().__init__(path, handler)


class _Handler(socketserver.BaseRequestHandler):
    """One ccache connection: the greeting, then requests until the client closes or stalls."""

    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.settimeout(REQUEST_TIMEOUT_S)
        bridge: Bridge = self.server.bridge  # type: ignore[attr-defined]  # set by _Server
        try:
            conn.sendall(bytes([PROTOCOL_VERSION, len(CAPABILITIES)]) + CAPABILITIES)
            while (op := _read(conn, 1)) is not None:
                reply = _answer(bridge, conn, op[0])
                if reply is None:
                    return
                conn.sendall(reply)
        except (OSError, ValueError) as exc:  # a stalled, closed or malformed client: its compile goes on
            _log.debug("compile cache bridge: connection ended: %s", exc)


def _answer(bridge: Bridge, conn: socket.socket, op: int) -> bytes | None:
    """The response to request ``op``; None ends the connection."""
    if op == _STOP:
        return None  # only a helper that ccache spawned stops on request; this one is the build's
    if op not in (_GET, _PUT, _REMOVE):
        return _err(f"unknown request {op}")
    key = _read_exactly(conn, _read_exactly(conn, 1)[0])
    if op == _GET:
        value = bridge.get(key)
        return _NOOP if value is None else _OK + _U64.pack(len(value)) + value
    if op == _REMOVE:
        return _NOOP  # nothing is removed from a shared tier: other builders may be reading it
    _read_exactly(conn, 1)  # put flags: create-only whatever overwrite says
    (length,) = _U64.unpack(_read_exactly(conn, _U64.size))
    if length > MAX_VALUE:
        raise ValueError(f"a value of {length} bytes")
    return _OK if bridge.put(key, _read_exactly(conn, length)) else _NOOP


def _err(message: str) -> bytes:
    text = message.encode()[:255]
    return _ERR + bytes([len(text)]) + text


def _read(conn: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None when the client closed the connection before the first."""
    first = conn.recv(size)
    if not first:
        return None
    return first + _read_exactly(conn, size - len(first)) if len(first) < size else first


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ValueError(f"the client closed the connection {left} bytes short")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
