"""The S3 store: the :class:`release.store.Store` protocol on boto3.

* Immutable objects (wheels, sidecars) are written with ``If-None-Match: *``
  and ``ChecksumSHA256``; a 412 means the key exists, and its hash decides
  between "same bytes, success" and :class:`IntegrityError`. After every write
  the hash is read back (``HEAD`` with ``ChecksumMode=ENABLED``, or a ``GET``
  when the server keeps no checksum — moto does not), because a store that
  accepted a checksum header is not proof that it checked it.
* Pages are written with ``If-Match: <etag>`` (or ``If-None-Match: *`` for a
  new page); a 412/409 is a :class:`ConflictError` for the caller to re-read.
* ``ExpectedBucketOwner`` goes on every call when configured, so a bucket
  taken over by another account is never written to.
* botocore errors are translated in one place, :func:`translate`, keeping the
  cause. Throttling and connection faults are retryable; access denied and
  integrity faults are permanent.

botocore's own retries (standard mode, bounded) handle short throttling
bursts; what still fails surfaces as a typed, retryable error for the caller's
bounded retry.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError

from release.errors import (
    AccessDeniedError,
    ConflictError,
    IntegrityError,
    InvalidInputError,
    PermanentError,
    ThrottledError,
    TransientStoreError,
)
from release.fsutil import sha256_bytes
from release.store import ObjectInfo, Store, check_key

log = logging.getLogger("kiln.s3")

_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "503"}
_TRANSIENT = {"InternalError", "RequestTimeout", "ServiceUnavailable", "500", "502", "504"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"}
_INTEGRITY = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
_CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "OperationAborted"}
_MISSING = {"NoSuchKey", "404", "NotFound"}

MAX_ATTEMPTS = 5  # botocore's own bounded retries per call


class _Missing(Exception):
    """Internal: the key does not exist (a normal answer, not an error)."""


def translate(exc: Exception, what: str) -> NoReturn:
    """Raise the Kiln error for a botocore error; the one place that knows S3 error codes."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        detail = f"{what}: {code or status} {error.get('Message', '')}".strip()
        for codes, kind in (
            (_MISSING, _Missing),
            (_CONFLICT, ConflictError),
            (_THROTTLED, ThrottledError),
            (_TRANSIENT, TransientStoreError),
            (_DENIED, AccessDeniedError),
            (_INTEGRITY, IntegrityError),
        ):
            if code in codes or (not code and status in codes):
                raise kind(detail) from exc
        if code == "NoSuchBucket":
            raise InvalidInputError(f"{detail}; check the target's bucket name in kiln.toml") from exc
        if status.startswith("5"):
            raise TransientStoreError(detail) from exc
        raise PermanentError(detail) from exc
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        raise TransientStoreError(f"{what}: {exc}") from exc
    if isinstance(exc, BotoCoreError):
        raise PermanentError(f"{what}: {exc}") from exc
    raise exc


def _b64_to_hex(value: str | None) -> str | None:
    if not value or "-" in value:  # a multipart "checksum of checksums" is not the file's hash
        return None
    try:
        return base64.b64decode(value).hex()
    except (binascii.Error, ValueError):
        return None


class S3Store:
    """Objects under ``s3://bucket/prefix``; see the module docstring for the guarantees."""

    def __init__(self, client: Any, bucket: str, prefix: str = "", expected_owner: str | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.expected_owner = expected_owner
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")

    def _params(self, key: str | None = None, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"Bucket": self.bucket, **extra}
        if key is not None:
            params["Key"] = self.prefix + check_key(key)
        if self.expected_owner:
            params["ExpectedBucketOwner"] = self.expected_owner
        return params

    def _call(self, operation: str, what: str, **params: Any) -> Any:
        method: Callable[..., Any] = getattr(self.client, operation)
        try:
            return method(**params)
        except (ClientError, BotoCoreError) as exc:
            translate(exc, f"{operation} {what}")

    def get(self, key: str) -> bytes | None:
        page = self.get_page(key)
        return None if page is None else page[0]

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        try:
            response = self._call("get_object", f"{self.url}/{key}", **self._params(key))
        except _Missing:
            return None
        with response["Body"] as body:
            try:
                data = body.read()
            except (BotoCoreError, OSError) as exc:
                raise TransientStoreError(f"reading {self.url}/{key}: {exc}") from exc
        return data, response["ETag"]

    def head(self, key: str) -> ObjectInfo | None:
        try:
            response = self._call("head_object", f"{self.url}/{key}", **self._params(key, ChecksumMode="ENABLED"))
        except _Missing:
            return None
        digest = _b64_to_hex(response.get("ChecksumSHA256"))
        if digest is None:
            # No server-side SHA-256 (moto, or an object uploaded without one):
            # hash the bytes ourselves rather than report an unverified object.
            data = self.get(key)
            if data is None:
                return None
            digest = sha256_bytes(data)
        return ObjectInfo(key, int(response["ContentLength"]), response["ETag"], digest)

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        digest = sha256_bytes(data)
        checksum = base64.b64encode(bytes.fromhex(digest)).decode()
        params = self._params(
            key, Body=data, ContentType=content_type, CacheControl=cache_control,
            ChecksumSHA256=checksum, IfNoneMatch="*",
        )
        try:
            self._call("put_object", f"{self.url}/{key}", **params)
            log.debug("uploaded %s/%s (%d bytes)", self.url, key, len(data))
        except (ConflictError, _Missing):
            log.debug("%s/%s exists; comparing hashes", self.url, key)
        info = self.head(key)
        if info is None:
            raise TransientStoreError(f"{self.url}/{key} is missing right after it was written; retry")
        if info.sha256 != digest:
            raise IntegrityError(
                f"{self.url}/{key} holds sha256 {info.sha256}, not {digest}; published files are immutable"
                " — bump the version instead of re-uploading"
            )
        return info

    def put_page(
        self, key: str, data: bytes, content_type: str, cache_control: str, expected_etag: str | None
    ) -> ObjectInfo:
        condition = {"IfNoneMatch": "*"} if expected_etag is None else {"IfMatch": expected_etag}
        checksum = base64.b64encode(bytes.fromhex(sha256_bytes(data))).decode()
        params = self._params(
            key, Body=data, ContentType=content_type, CacheControl=cache_control,
            ChecksumSHA256=checksum, **condition,
        )
        try:
            response = self._call("put_object", f"{self.url}/{key}", **params)
        except _Missing as exc:  # If-Match on a key deleted behind our back
            raise ConflictError(f"{self.url}/{key} disappeared since it was read") from exc
        return ObjectInfo(key, len(data), response["ETag"], sha256_bytes(data))

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(**self._params(Prefix=self.prefix + prefix)):
                keys.extend(item["Key"][len(self.prefix):] for item in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            translate(exc, f"list {self.url}/{prefix}")
        return sorted(keys)


def make_client(session: Any = None, region: str | None = None, endpoint: str | None = None) -> Any:
    """A boto3 S3 client with bounded retries and timeouts."""
    config = Config(
        retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        # send our own SHA-256 header instead of botocore's default CRC trailer
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if endpoint else None,
    )
    session = session if session is not None else boto3.Session()
    return session.client("s3", region_name=region, endpoint_url=endpoint, config=config)


def open_s3_store(
    url: str,
    *,
    root: Path | None = None,
    region: str | None = None,
    endpoint: str | None = None,
    expected_owner: str | None = None,
    session: Any = None,
) -> Store:
    """Open ``s3://bucket/prefix``; ``root`` is unused (S3 keys are absolute)."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidInputError(f"store URL {url!r} names no bucket")
    if prefix.strip("/"):
        check_key(prefix.strip("/"))
    try:
        client = make_client(session, region, endpoint)
    except (BotoCoreError, ValueError) as exc:
        raise InvalidInputError(f"cannot open {url}: {exc}") from exc
    return S3Store(client, bucket, prefix, expected_owner)


__all__ = ["S3Store", "make_client", "open_s3_store", "translate"]
