"""The S3 store: the :class:`kiln.core.store.Store` protocol on boto3.

* Immutable objects (wheels, sidecars) are written with ``If-None-Match: *``
  and ``ChecksumSHA256``, with no existence check first: a 412 means the key
  exists, and only then its hash decides between "same bytes, success" and
  :class:`AlreadyPublishedError`. (botocore sends ``Expect: 100-continue``, so
  a server that refuses the precondition need not receive the body.) A wheel
  is sent from its open file, streamed, with the hash its caller streamed.
* Whether a write needs reading back is a property of the store,
  ``verifies_checksums``: AWS S3 refuses a body whose SHA-256 differs from the
  ``ChecksumSHA256`` header (``BadDigest``) and echoes the checksum it
  verified, so a write it acknowledged with that echo is proof of the bytes.
  A store that accepted a checksum header is not proof that it checked it
  (moto does not check): there, and whenever the echo is missing, the object
  is read back (``GET``) and hashed, and a hash that differs is an
  :class:`IntegrityError`. On such a store :meth:`S3Store.head` hashes the
  bytes too instead of trusting a stored checksum.
* Pages are written with ``If-Match: <etag>`` (or ``If-None-Match: *`` for a
  new page); a 412/409 is a :class:`ConflictError` for the caller to re-read.
* Every write carries the ``Cache-Control`` its caller chose for the object's
  kind (the publish protocol: long and ``immutable`` for wheels, sidecars and
  variants files, whose keys are never re-used; ``no-cache`` or short for
  pages, by channel) and its SHA-256 as object metadata
  (``x-amz-meta-sha256``), so a CDN or a human with ``aws s3api head-object``
  can compare what is served with what was written without reading it.
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
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from kiln.core.errors import (
    AccessDeniedError,
    AlreadyPublishedError,
    ConflictError,
    IntegrityError,
    InvalidInputError,
    PermanentError,
    ThrottledError,
    TransientStoreError,
)
from kiln.core.fsutil import sha256_bytes
from kiln.core.objects import BotoSession, ObjectInfo, Store, check_key

log = logging.getLogger(__name__)

_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "503"}
_TRANSIENT = {"InternalError", "RequestTimeout", "ServiceUnavailable", "500", "502", "504"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"}
_INTEGRITY = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
_CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "OperationAborted"}
_MISSING = {"NoSuchKey", "404", "NotFound"}
_CHUNK = 1 << 20  # what a read-back hashes at a time

MAX_ATTEMPTS = 5  # botocore's own bounded retries per call
# The user metadata key every write stores its hex SHA-256 under (S3 serves it as ``x-amz-meta-sha256``).
# What the uploader claimed, for a CDN's or a reader's comparison: head() still trusts only a verified checksum.
SHA256_METADATA = "sha256"


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

    # Any: a boto3 S3 client (boto3's clients carry no types)
    def __init__(self, client: Any, bucket: str, prefix: str = "", expected_owner: str | None = None,
                 verifies_checksums: bool = False) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.expected_owner = expected_owner
        # False (read every write back) unless the caller knows the server verifies: the safe default.
        self.verifies_checksums = verifies_checksums
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._warned_unconfirmed = False

    # Any: the keyword arguments of a boto3 call (untyped)
    def _params(self, key: str | None = None, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"Bucket": self.bucket, **extra}
        if key is not None:
            params["Key"] = self.prefix + check_key(key)
        if self.expected_owner:
            params["ExpectedBucketOwner"] = self.expected_owner
        return params

    # Any: the keyword arguments of a boto3 call (untyped)
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
        if not self.verifies_checksums:
            return self._hashed(key)  # a stored checksum here is only what some uploader claimed
        try:
            response = self._call("head_object", f"{self.url}/{key}", **self._params(key, ChecksumMode="ENABLED"))
        except _Missing:
            return None
        digest = _b64_to_hex(response.get("ChecksumSHA256"))
        if digest is None:  # uploaded without a SHA-256: hash the bytes rather than report an unverified object
            return self._hashed(key)
        return ObjectInfo(key, int(response["ContentLength"]), response["ETag"], digest)

    def _hashed(self, key: str) -> ObjectInfo | None:
        """The object's size and sha256, hashed as its body streams in: a wheel read back is never held whole."""
        try:
            response = self._call("get_object", f"{self.url}/{key}", **self._params(key))
        except _Missing:
            return None
        digest, size = hashlib.sha256(), 0
        with response["Body"] as body:
            try:
                for block in iter(lambda: body.read(_CHUNK), b""):
                    digest.update(block)
                    size += len(block)
            except (BotoCoreError, OSError) as exc:
                raise TransientStoreError(f"reading {self.url}/{key}: {exc}") from exc
        return ObjectInfo(key, size, response["ETag"], digest.hexdigest())

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        return self._create(key, data, sha256_bytes(data), len(data), content_type, cache_control)

    def put_immutable_file(
        self, key: str, path: Path, sha256: str, content_type: str, cache_control: str
    ) -> ObjectInfo:
        # An open file as the body: botocore streams it (and seeks back to resend it on a retry). A file
        # changed since ``sha256`` was taken is refused by a verifying server (BadDigest) or by the read-back.
        with open(path, "rb") as handle:
            return self._create(key, handle, sha256, os.fstat(handle.fileno()).st_size, content_type, cache_control)

    def _create(self, key: str, body: bytes | BinaryIO, digest: str, size: int, content_type: str,
                cache_control: str) -> ObjectInfo:
        """The create-only write of both put_immutable kinds: ``body`` is sent with ``digest`` as its checksum."""
        checksum = base64.b64encode(bytes.fromhex(digest)).decode()
        params = self._params(
            key, Body=body, ContentType=content_type, CacheControl=cache_control,
            ChecksumSHA256=checksum, IfNoneMatch="*", Metadata={SHA256_METADATA: digest},
        )
        try:
            response = self._call("put_object", f"{self.url}/{key}", **params)
        except (ConflictError, _Missing):
            log.debug("%s/%s exists; comparing hashes", self.url, key)
            return self._existing(key, digest)
        log.debug("uploaded %s/%s (%d bytes)", self.url, key, size)
        if self.verifies_checksums and response.get("ChecksumSHA256") == checksum:
            return ObjectInfo(key, size, response["ETag"], digest, created=True)
        if self.verifies_checksums and not self._warned_unconfirmed:
            self._warned_unconfirmed = True
            log.warning("%s did not confirm the ChecksumSHA256 of a write; reading writes back instead."
                        " Set verifies_checksums = false for this target if it never does", self.url)
        return self._read_back(key, digest)

    def _existing(self, key: str, digest: str) -> ObjectInfo:
        """The object a create-only write found in place: the same bytes, or AlreadyPublishedError."""
        info = self.head(key)
        if info is None:  # a 409 of a concurrent write that then failed, or a 412 racing nothing we can see
            raise TransientStoreError(f"{self.url}/{key} was refused as existing but is not there; retry")
        if info.sha256 != digest:
            raise AlreadyPublishedError.held(f"{self.url}/{key}", info.sha256, digest)
        return info

    def _read_back(self, key: str, digest: str) -> ObjectInfo:
        """Hash what the store now holds under a key this call wrote; other bytes are an IntegrityError."""
        info = self._hashed(key)
        if info is None:
            raise TransientStoreError(f"{self.url}/{key} is missing right after it was written; retry")
        if info.sha256 != digest:
            raise IntegrityError(
                f"{self.url}/{key} holds sha256 {info.sha256}, not {digest} right after it was written:"
                " the bytes were changed in transit, by another writer or in the file after it was hashed; nothing"
                " is listed — retry the publish"
            )
        return ObjectInfo(key, info.size, info.etag, digest, created=True)

    def put_page(
        self, key: str, data: bytes, content_type: str, cache_control: str, expected_etag: str | None
    ) -> ObjectInfo:
        condition = {"IfNoneMatch": "*"} if expected_etag is None else {"IfMatch": expected_etag}
        digest = sha256_bytes(data)
        checksum = base64.b64encode(bytes.fromhex(digest)).decode()
        params = self._params(
            key, Body=data, ContentType=content_type, CacheControl=cache_control,
            ChecksumSHA256=checksum, Metadata={SHA256_METADATA: digest}, **condition,
        )
        try:
            response = self._call("put_object", f"{self.url}/{key}", **params)
        except _Missing as exc:  # If-Match on a key deleted behind our back
            raise ConflictError(f"{self.url}/{key} disappeared since it was read") from exc
        return ObjectInfo(key, len(data), response["ETag"], digest)

    def delete(self, key: str) -> None:
        """Remove ``key`` (S3 answers success for a missing one). Only a prune deletes
        (:mod:`kiln.release.publish.prune`), with credentials whose policy allows it under one prefix."""
        try:
            self._call("delete_object", f"{self.url}/{key}", **self._params(key))
        except _Missing:
            return
        log.debug("deleted %s/%s", self.url, key)

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(**self._params(Prefix=self.prefix + prefix)):
                keys.extend(item["Key"][len(self.prefix):] for item in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            translate(exc, f"list {self.url}/{prefix}")
        return sorted(keys)


def make_client(session: BotoSession | None = None, region: str | None = None, endpoint: str | None = None) -> Any:
    """A boto3 S3 client with bounded retries and timeouts (Any: boto3's clients are untyped)."""
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
    session: BotoSession | None = None,
    verifies_checksums: bool | None = None,
) -> Store:
    """Open ``s3://bucket/prefix``; ``root`` is unused (S3 keys are absolute).

    ``verifies_checksums`` None means AWS's behaviour when no ``endpoint`` is
    given (AWS verifies) and the safe one for a custom endpoint (read back).
    """
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
    verifies = endpoint is None if verifies_checksums is None else verifies_checksums
    return S3Store(client, bucket, prefix, expected_owner, verifies_checksums=verifies)


__all__ = ["S3Store", "make_client", "open_s3_store", "translate"]
