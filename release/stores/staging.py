"""A copy-on-write view of a store, for dry runs.

Reads see the staging directory first and the real target behind it; writes
land in the staging directory only. The whole publish protocol runs against
it unchanged — same create-only checks against what the target already
holds, same compare-and-swap — so the plan it produces is the plan a real
run would carry out, and the target is never written.
"""

from __future__ import annotations

from pathlib import Path

from kiln.core.errors import AlreadyPublishedError, ConflictError
from kiln.core.fsutil import sha256_bytes
from kiln.core.store import LocalStore, ObjectInfo, Store


class StagingStore:
    """``target`` is only read; every write goes to a :class:`LocalStore` at ``staging_dir``."""

    def __init__(self, target: Store, staging_dir: Path) -> None:
        self.target = target
        self.staging = LocalStore(staging_dir)
        self.url = target.url

    def get(self, key: str) -> bytes | None:
        page = self.get_page(key)
        return None if page is None else page[0]

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        staged = self.staging.get(key)
        if staged is not None:
            return staged, sha256_bytes(staged)
        real = self.target.get(key)
        return None if real is None else (real, sha256_bytes(real))

    def head(self, key: str) -> ObjectInfo | None:
        return self.staging.head(key) or self.target.head(key)

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        existing = self.target.head(key)
        if existing is not None:
            digest = sha256_bytes(data)
            if existing.sha256 != digest:
                raise AlreadyPublishedError.held(f"{self.url}/{key}", existing.sha256, digest)
            return existing  # created=False: the target holds it already
        return self.staging.put_immutable(key, data, content_type, cache_control)

    def put_immutable_file(
        self, key: str, path: Path, sha256: str, content_type: str, cache_control: str
    ) -> ObjectInfo:
        existing = self.target.head(key)
        if existing is not None:
            if existing.sha256 != sha256:
                raise AlreadyPublishedError.held(f"{self.url}/{key}", existing.sha256, sha256)
            return existing  # created=False: the target holds it already
        return self.staging.put_immutable_file(key, path, sha256, content_type, cache_control)

    def put_page(
        self, key: str, data: bytes, content_type: str, cache_control: str, expected_etag: str | None
    ) -> ObjectInfo:
        current = self.get_page(key)
        if (None if current is None else current[1]) != expected_etag:
            raise ConflictError(f"{self.url}/{key} changed since it was read (staging)")
        staged = self.staging.get_page(key)
        self.staging.put_page(key, data, content_type, cache_control, None if staged is None else staged[1])
        digest = sha256_bytes(data)
        return ObjectInfo(key, len(data), digest, digest)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(set(self.target.list(prefix)) | set(self.staging.list(prefix)))
