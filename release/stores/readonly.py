"""A store that only reads: every write raises, naming the key, and reaches nothing.

For a caller that must never change the store it reads (``kiln bisect`` reads stored runs and wheels): a
bug or a crafted input that would make it write fails loudly instead. On S3 its credentials are narrowed
to reads as well (:func:`kiln.release.stores.policies.read_only`).
"""

from __future__ import annotations

from pathlib import Path

from kiln.core.errors import AccessDeniedError
from kiln.core.objects import ObjectInfo, Store


class ReadOnlyStore:
    """``inner``'s reads; its writes refused."""

    def __init__(self, inner: Store, why: str) -> None:
        self._inner = inner
        self._why = why
        self.url = inner.url

    def _refused(self, key: str) -> AccessDeniedError:
        return AccessDeniedError(f"{self.url}/{key}: this store is open read-only ({self._why}); nothing was written")

    def get(self, key: str) -> bytes | None:
        return self._inner.get(key)

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        return self._inner.get_page(key)

    def head(self, key: str) -> ObjectInfo | None:
        return self._inner.head(key)

    def list(self, prefix: str = "") -> list[str]:
        return self._inner.list(prefix)

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        raise self._refused(key)

    def put_immutable_file(self, key: str, path: Path, sha256: str, content_type: str,
                           cache_control: str) -> ObjectInfo:
        raise self._refused(key)

    def put_page(self, key: str, data: bytes, content_type: str, cache_control: str,
                 expected_etag: str | None) -> ObjectInfo:
        raise self._refused(key)

    def delete(self, key: str) -> None:
        raise self._refused(key)
