"""What every store backend shares: the :class:`Store` protocol, :class:`ObjectInfo` and the key rule.

Below both backends (:mod:`kiln.core.store` opens stores and holds the local
one; :mod:`kiln.core.s3` holds the S3 one), so the S3 backend never imports
the module that imports it. :mod:`kiln.core.store` re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kiln.core.errors import InvalidInputError


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object without reading it."""

    key: str
    size: int
    etag: str
    sha256: str | None  # hex; None when the backend has no checksum stored for it
    # True only on what a create-only write (put_immutable, put_immutable_file) that wrote the
    # object returns. A fact about that call, not the object, hence left out of equality.
    created: bool = field(default=False, compare=False)


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root or confuse a URL.

    Absolute keys, ``..``/``.`` segments, backslashes, empty segments and
    control characters are all refused with :class:`InvalidInputError`.
    """
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"store key {key!r} is empty")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise InvalidInputError(f"store key {key!r} contains a control character")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise InvalidInputError(
            f"store key {key!r} must be a relative POSIX path without '..', '.', '//' or backslashes"
        )
    return key


@runtime_checkable
class BotoSession(Protocol):
    """What a store asks of a ``boto3.Session``: a client, with the step's credentials in it.

    A Protocol, not boto3's class: boto3 carries no annotations (its Session reads as Any to mypy), and
    naming it here would import boto3 where no S3 store is opened.
    """

    # Any: boto3's clients and their keyword arguments (region_name, endpoint_url, config) are untyped.
    def client(self, service_name: str, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class Store(Protocol):
    """The operations publishing and history need; every backend implements all of them."""

    url: str

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (for a later :meth:`put_page`), or None."""

    def head(self, key: str) -> ObjectInfo | None:
        """Size, ETag and SHA-256 of an object, or None when it does not exist."""

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        """Create ``key`` with ``data``; same bytes already there is success (``created`` False),
        other bytes :class:`~kiln.core.errors.AlreadyPublishedError`."""

    def put_immutable_file(
        self, key: str, path: Path, sha256: str, content_type: str, cache_control: str
    ) -> ObjectInfo:
        """:meth:`put_immutable` of the file ``path``, streamed, never held whole in memory.

        ``sha256`` is the caller's hash of the file (hex); the store checks that
        what it wrote is exactly that, and raises
        :class:`~kiln.core.errors.IntegrityError` when the file changed after
        it was hashed."""

    def put_page(
        self, key: str, data: bytes, content_type: str, cache_control: str, expected_etag: str | None
    ) -> ObjectInfo:
        """Replace ``key`` only if its ETag is still ``expected_etag`` (None: only if absent)."""

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` (a plain string prefix of the key)."""
