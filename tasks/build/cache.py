"""Content-addressed build cache that heals itself.

Layout under ``root`` (a local directory or a mounted shared volume):

- ``objects/<sha[:2]>/<sha256>`` — artifact bytes, named by their hash;
- ``entries/<batch>/<key>.json`` — one entry per build unit: the files it
  produced with their sha256 and size;
- ``entries/wheels/<key>.json`` — one per written wheel, keyed by its members
  (``kiln.tasks.wheel.assemble.wheel_key``), so a warm build copies it;
- ``unit-seconds/<digest(unit id)>.json`` — the last full compile's seconds of a build unit, whatever its
  key: the basis of what a later partial compile (some translation units from the compile cache) saved.

An entry's ``info`` may carry the seconds its compile took (:mod:`kiln.tasks.build.compile_seconds`); an
entry written before it did has none, and a hit on it reports no saved seconds.

A *batch* is one build generation: the units of one kernel built from the
same sources and toolchain for one backend; the batch id is the key prefix
that groups them. Every read re-hashes the object: an entry whose artifact is
missing, truncated or has another hash raises :class:`CacheDriftError` after
its whole batch has been invalidated, so the caller's retry (or the next run)
rebuilds the batch from source — never a silent wrong artifact.

Writes are atomic (temp file + rename in the same directory), so concurrent
builders sharing the root see whole entries or none.

With a :class:`~kiln.tasks.build.cache_remote.RemoteTier` (``[build.cache] remote``), a local miss asks the
team's artifact store, and what it serves, re-hashed, is copied into the local tier; every entry put here is
published there too (create-only). The remote tier only ever turns a miss into a verified hit: its damage
is a miss, never a drift of the local batch, and its silence is a local-only build.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kiln.core.errors import CacheDriftError
from kiln.core.fsutil import atomic_write_bytes, atomic_write_text, digest, sha256_bytes, sha256_file
from kiln.tasks.build.cache_remote import RemoteTier

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheHit:
    key: str
    files: dict[str, bytes]  # name -> verified bytes
    info: Mapping[str, object] = field(default_factory=dict)  # the entry's info, as its builder wrote it


class BuildCache:
    def __init__(self, root: str | Path, remote: RemoteTier | None = None) -> None:
        self.root = Path(root)
        self.remote = remote

    def local(self) -> BuildCache:
        """This cache without its remote tier: for memos (wheels, audits) cheaper to remake than to fetch."""
        return BuildCache(self.root)

    def _entry_path(self, batch: str, key: str) -> Path:
        return self.root / "entries" / batch / f"{key}.json"

    def _object_path(self, sha: str) -> Path:
        return self.root / "objects" / sha[:2] / sha

    def put(self, batch: str, key: str, files: dict[str, bytes], info: dict[str, object] | None = None) -> None:
        """Store ``files`` under ``key`` in every tier; objects first, then the entry that names them."""
        entry = self._put_local(batch, key, files, info)
        if self.remote is not None:
            self.remote.put(batch, key, files, entry.encode())

    def _put_local(self, batch: str, key: str, files: dict[str, bytes], info: dict[str, object] | None) -> str:
        listed = {}
        for name, data in files.items():
            sha = sha256_bytes(data)
            target = self._object_path(sha)
            # An object already there may be the damaged copy that caused a drift.
            if not target.is_file() or sha256_file(target) != sha:
                atomic_write_bytes(target, data)
            listed[name] = {"sha256": sha, "size": len(data)}
        entry = json.dumps({"key": key, "batch": batch, "files": listed, "info": info or {}}, indent=2,
                           sort_keys=True)
        atomic_write_text(self._entry_path(batch, key), entry)
        return entry

    def get(self, batch: str, key: str) -> CacheHit | None:
        """The verified files of ``key``, ``None`` on a miss.

        Raises :class:`CacheDriftError` (retryable) when the entry's artifacts
        no longer match it; the batch is invalidated first so a retry rebuilds.
        """
        path = self._entry_path(batch, key)
        try:
            entry = json.loads(path.read_text())
            listed = entry["files"]
        except FileNotFoundError:
            return self._from_remote(batch, key)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._drift(batch, key, f"entry {path.name} is unreadable ({exc})")
        files = {}
        for name, meta in listed.items():
            obj = self._object_path(meta["sha256"])
            try:
                data = obj.read_bytes()
            except FileNotFoundError:
                self._drift(batch, key, f"artifact {name} ({meta['sha256'][:12]}) is missing")
            if len(data) != meta["size"] or sha256_bytes(data) != meta["sha256"]:
                self._drift(batch, key, f"artifact {name} has {len(data)} bytes and another sha256 than recorded")
            files[name] = data
        info = entry.get("info")
        return CacheHit(key, files, info if isinstance(info, dict) else {})

    def _from_remote(self, batch: str, key: str) -> CacheHit | None:
        """A verified hit of the remote tier, kept in the local one; None on its miss (or without one)."""
        if self.remote is None:
            return None
        found = self.remote.get(batch, key)
        if found is None:
            return None
        files, info = found
        self._put_local(batch, key, files, {**info, "from": "remote"})
        return CacheHit(key, files, info)

    def file(self, batch: str, key: str, name: str) -> bytes | None:
        """The verified bytes of one file of ``key``; ``None`` on a miss, and on a drift (logged, and the
        batch dropped by :meth:`get`), so the caller computes the entry afresh."""
        try:
            hit = self.get(batch, key)
        except CacheDriftError:
            return None
        return hit.files.get(name) if hit else None

    def _seconds_path(self, unit_id: str) -> Path:
        return self.root / "unit-seconds" / f"{digest(unit_id)}.json"

    def full_compile_seconds(self, unit_id: str) -> float | None:
        """The seconds the last full compile of ``unit_id`` took here (any key); None when none was recorded."""
        try:
            seconds = json.loads(self._seconds_path(unit_id).read_text()).get("full_compile_s")
        except (OSError, ValueError, AttributeError):
            return None  # never recorded, or unreadable: no basis, which the summary says
        return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None

    def note_full_compile(self, unit_id: str, seconds: float) -> None:
        """Record that a compile of every translation unit of ``unit_id`` took ``seconds`` (local tier only)."""
        atomic_write_text(self._seconds_path(unit_id),
                          json.dumps({"unit": unit_id, "full_compile_s": seconds}, sort_keys=True))

    def _drift(self, batch: str, key: str, why: str) -> None:
        removed = self.invalidate_batch(batch)
        message = (
            f"build cache drift in entry {key[:16]}: {why}; invalidated batch {batch[:16]}"
            f" ({removed} entries), they will be rebuilt"
        )
        _log.warning(message)
        raise CacheDriftError(message)

    def invalidate_batch(self, batch: str) -> int:
        """Drop every entry of ``batch``; returns how many there were.

        Objects stay: they are named by hash, so a stale one can never be
        served for a different entry, and a shared one may back other batches.
        """
        directory = self.root / "entries" / batch
        if not directory.is_dir():
            return 0
        count = sum(1 for _ in directory.glob("*.json"))
        # Rename first so concurrent readers see the batch vanish at once.
        doomed = directory.with_name(f".{batch}.invalid.{uuid.uuid4().hex}")
        try:
            directory.rename(doomed)
        except FileNotFoundError:
            return 0
        shutil.rmtree(doomed, ignore_errors=True)
        return count

    def verify(self, batch: str, keys: list[str]) -> str | None:
        """Check ``keys`` of one batch; on drift invalidate it and return the event message."""
        for key in keys:
            try:
                self.get(batch, key)
            except CacheDriftError as exc:
                return str(exc)
        return None
