"""The unit cache's second tier: the team's artifact store, under the worker's own directory.

Layout under ``<prefix>/`` in the store (an ``s3://`` bucket prefix or a shared ``file://`` directory):

- ``objects/<sha256>`` — artifact bytes, written create-only under their hash (``If-None-Match: *`` on S3,
  ``link()`` on a directory), so no writer can replace what another wrote;
- ``entries/<batch>/<key>.json`` — the unit's entry as the local tier writes it (file names, sha256, sizes),
  also create-only: the first builder of a key wins, and a later one finds its own entry or an equal one.

Nothing read from here is trusted: every object is re-hashed against the entry that names it, and an entry
whose names or hashes are malformed, or whose object is missing, truncated or has other bytes, is a *miss*
(logged, counted in :attr:`RemoteTier.stats`) and the unit is compiled again — the wrong bytes never reach a
wheel. A store that does not answer (connection refused, throttled past botocore's own bounded retries)
turns the tier off for the rest of the build with one warning: the build goes on with its local tier only.
A store that refuses a write (a read-only role) stops this tier's writes and keeps its reads.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kiln.core.errors import AccessDeniedError, IntegrityError, KilnError
from kiln.core.fsutil import sha256_bytes
from kiln.core.objects import Store

_log = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdef")
_CONTENT_TYPE = "application/octet-stream"
_CACHE_CONTROL = "public, max-age=31536000, immutable"  # a key never names other bytes


@dataclass
class TierStats:
    """What the tier did in one build: entries served and missed, entries refused as damaged, entries written."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    written: int = 0
    unreachable: str = ""  # why the tier was turned off, "" while it answers
    read_only: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "rejected": self.rejected, "written": self.written,
                "unreachable": self.unreachable, "read_only": self.read_only}


def _sha(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _file_name(value: object) -> bool:
    """A unit's file name as the local tier writes it: one path component, printable, not hidden."""
    return (isinstance(value, str) and bool(value) and "/" not in value and "\\" not in value
            and not value.startswith(".") and all(ord(ch) >= 32 for ch in value))


def checked_listing(entry: object) -> dict[str, tuple[str, int]] | None:
    """``{name: (sha256, size)}`` of a stored entry, or None when it is not one (forged or torn)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
        return None
    listing = {}
    for name, meta in entry["files"].items():
        if not _file_name(name) or not isinstance(meta, dict) or not _sha(meta.get("sha256")):
            return None
        size = meta.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        listing[name] = (meta["sha256"], size)
    return listing


@dataclass
class RemoteTier:
    """The artifact store's tier of :class:`kiln.tasks.build.cache.BuildCache`; safe to share between threads."""

    store: Store
    prefix: str = "build-cache"
    read_only: bool = False
    stats: TierStats = field(default_factory=TierStats)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Keys this build found missing or refused: asked once per build (the cache is read by the verify pass,
    # the cached-units pass and the unit itself), so each counts once and costs one round trip.
    _absent: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.prefix = self.prefix.strip("/")
        self.stats.read_only = self.read_only

    def _entry_key(self, batch: str, key: str) -> str:
        return f"{self.prefix}/entries/{batch}/{key}.json"

    def _object_key(self, sha: str) -> str:
        return f"{self.prefix}/objects/{sha}"

    @property
    def answering(self) -> bool:
        return not self.stats.unreachable

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self.stats, what, getattr(self.stats, what) + 1)

    def _give_up(self, exc: KilnError, doing: str) -> None:
        """Turn the tier off for this build (once, with one warning): the local tier carries on alone."""
        with self._lock:
            first = not self.stats.unreachable
            self.stats.unreachable = f"{doing}: {exc}"
        if first:
            _log.warning("build cache: the shared tier at %s did not answer (%s: %s); this build goes on with its "
                         "local cache only", getattr(self.store, "url", self.prefix), doing, exc)

    def get(self, batch: str, key: str) -> tuple[dict[str, bytes], dict[str, object]] | None:
        """The verified files of ``key`` from the store and its entry's info; None on a miss, a damaged entry
        or a silent store."""
        if not self.answering or (batch, key) in self._absent:
            return None
        try:
            raw = self.store.get(self._entry_key(batch, key))
            found = None if raw is None else self._verified(batch, key, raw)
            if raw is None:
                self._count("misses")
            if found is None:
                with self._lock:
                    self._absent.add((batch, key))
            return found
        except KilnError as exc:
            self._give_up(exc, f"reading entry {key[:16]}")
            return None

    def _verified(self, batch: str, key: str, raw: bytes) -> tuple[dict[str, bytes], dict[str, object]] | None:
        try:
            entry = json.loads(raw)
        except ValueError:
            entry = None
        listing = checked_listing(entry)
        if listing is None:
            self._reject(key, f"entry {batch[:16]}/{key[:16]} is not a cache entry")
            return None
        files = {}
        for name, (sha, size) in listing.items():
            data = self.store.get(self._object_key(sha))
            if data is None:
                self._reject(key, f"object {sha[:12]} of {name} is missing")
                return None
            if len(data) != size or sha256_bytes(data) != sha:
                self._reject(key, f"object {sha[:12]} of {name} has {len(data)} bytes and another sha256 than "
                                  "its name")
                return None
            files[name] = data
        self._count("hits")
        info = entry.get("info") if isinstance(entry, dict) else None
        return files, (info if isinstance(info, dict) else {})

    def _reject(self, key: str, why: str) -> None:
        _log.warning("build cache: shared entry %s refused (%s); the unit is built again", key[:16], why)
        self._count("rejected")

    def put(self, batch: str, key: str, files: dict[str, bytes], entry: bytes) -> None:
        """Publish ``files`` (objects first, then the ``entry`` that names them); never raises for the store."""
        if self.read_only or not self.answering:
            return
        doing = f"writing entry {key[:16]}"
        try:
            for data in files.values():
                self._put_object(data)
            self.store.put_immutable(self._entry_key(batch, key), entry, "application/json", _CACHE_CONTROL)
        except AccessDeniedError as exc:
            _log.warning("build cache: the shared tier refused a write (%s); this build only reads it", exc)
            self.read_only = self.stats.read_only = True
            return
        except IntegrityError as exc:
            # Another builder's entry for this key (other info, or a forged object squatting on a hash):
            # theirs stays, ours is in the local tier; a reader re-hashes whatever it finds.
            _log.warning("build cache: %s kept the shared tier's existing object (%s)", doing, exc)
            return
        except KilnError as exc:
            self._give_up(exc, doing)
            return
        self._count("written")

    def _put_object(self, data: bytes) -> None:
        self.store.put_immutable(self._object_key(sha256_bytes(data)), data, _CONTENT_TYPE, _CACHE_CONTROL)
