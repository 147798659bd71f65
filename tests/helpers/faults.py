"""Fault injectors for release tests (these are the only fakes in the release tests, and they say so).

The S3 ones hook botocore's event system on a real client talking to moto's
real server, so everything except the injected fault is the genuine code
path. :class:`CorruptingStore` wraps a real store and damages the bytes of
chosen keys on their way in, as a faulty proxy or disk would.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from botocore.awsrequest import AWSResponse

from kiln.core.fsutil import sha256_file
from kiln.core.store import LocalStore, ObjectInfo, Store


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def error_response(request: Any, status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected by a test</Message></Error>".encode()
    return AWSResponse(request.url, status, {}, _Raw(body))


def inject_throttling(client: Any, fraction: float, seed: int = 0) -> list[int]:
    """Answer ``fraction`` of requests with 503 SlowDown before they reach the server; returns a hit counter."""
    rng = random.Random(seed)
    hits = [0]

    def maybe_throttle(request: Any, **_: Any) -> AWSResponse | None:
        if rng.random() < fraction:
            hits[0] += 1
            return error_response(request, 503, "SlowDown")
        return None

    client.meta.events.register_first("before-send.s3", maybe_throttle)
    return hits


def kill_after(client: Any, requests: int) -> list[int]:
    """SIGKILL this process just before request number ``requests + 1`` is sent (crash injection)."""
    sent = [0]

    def count(request: Any, **_: Any) -> None:
        if sent[0] >= requests:
            os.kill(os.getpid(), signal.SIGKILL)
        sent[0] += 1

    client.meta.events.register_first("before-send.s3", count)
    return sent


class HookedLocalStore(LocalStore):
    """A real local store that calls :meth:`before_write` with the key before every write and delete
    (fault injection, or noting the order of writes); subclasses override only the hook."""

    def before_write(self, key: str) -> None:
        """Called first by every write and delete; nothing by default."""

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        self.before_write(key)
        return super().put_immutable(key, data, content_type, cache_control)

    def put_immutable_file(self, key: str, path: Path, sha256: str, content_type: str,
                           cache_control: str) -> ObjectInfo:
        self.before_write(key)
        return super().put_immutable_file(key, path, sha256, content_type, cache_control)

    def put_page(self, key: str, data: bytes, content_type: str, cache_control: str,
                 expected_etag: str | None) -> ObjectInfo:
        self.before_write(key)
        return super().put_page(key, data, content_type, cache_control, expected_etag)

    def delete(self, key: str) -> None:
        self.before_write(key)
        super().delete(key)


class ForwardingStore:
    """A real store behind every Store method; a fault-injecting wrapper overrides only the calls it changes."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url = inner, inner.url

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        return self.inner.get_page(key)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        return self.inner.put_immutable(key, data, content_type, cache_control)

    def put_immutable_file(self, key: str, path: Path, sha256: str, content_type: str,
                           cache_control: str) -> ObjectInfo:
        return self.inner.put_immutable_file(key, path, sha256, content_type, cache_control)

    def put_page(self, key: str, data: bytes, content_type: str, cache_control: str,
                 expected_etag: str | None) -> ObjectInfo:
        return self.inner.put_page(key, data, content_type, cache_control, expected_etag)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)


class CorruptingStore(ForwardingStore):
    """A real store whose immutable writes of keys ending in ``suffix`` land with one byte flipped.

    Every later read (the write's own answer, ``head``, ``get``) sees the
    damaged bytes (a file is damaged past the store's own hash check), so
    what the store reads back differs from what was uploaded: the publish
    protocol must notice and list nothing.
    """

    def __init__(self, inner: Store, suffix: str) -> None:
        super().__init__(inner)
        self.suffix = suffix
        self.corrupted: list[str] = []

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        if key.endswith(self.suffix):
            self.corrupted.append(key)
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        return self.inner.put_immutable(key, data, content_type, cache_control)

    def put_immutable_file(self, key: str, path: Path, sha256: str, content_type: str,
                           cache_control: str) -> ObjectInfo:
        if not key.endswith(self.suffix):
            return self.inner.put_immutable_file(key, path, sha256, content_type, cache_control)
        self.corrupted.append(key)
        data = path.read_bytes()  # a test's tiny wheel
        with tempfile.TemporaryDirectory() as tmp:
            damaged = Path(tmp) / path.name
            damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
            # damaged past the store's own check, as a faulty disk would: the store holds and reports other bytes
            return self.inner.put_immutable_file(key, damaged, sha256_file(damaged), content_type, cache_control)


def echo_checksums(client: Any) -> None:
    """Answer as AWS S3 does about ``ChecksumSHA256``: echoed by a PutObject, returned by a HeadObject.

    AWS verifies the checksum it is sent, echoes it and returns it on a HEAD
    with ``ChecksumMode=ENABLED``; moto does none of this. This simulates only
    the answers (moto still checks nothing), so that the request count of a
    store with ``verifies_checksums`` can be measured on moto. Requests on
    ``client`` must be sequential.
    """
    last: dict[str, Any] = {}
    stored: dict[str, str] = {}  # URL -> checksum of objects written through this client

    def remember(request: Any, **_: Any) -> None:
        value = request.headers.get("x-amz-checksum-sha256")
        last["url"], last["checksum"] = request.url, value.decode() if isinstance(value, bytes) else value

    def put(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
        if response_dict.get("status_code") == 200 and last.get("checksum"):
            stored[last["url"]] = customized_response_dict["ChecksumSHA256"] = last["checksum"]

    def head(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
        if response_dict.get("status_code") == 200 and last.get("url") in stored:
            customized_response_dict["ChecksumSHA256"] = stored[last["url"]]

    client.meta.events.register("before-send.s3", remember)
    client.meta.events.register("before-parse.s3.PutObject", put)
    client.meta.events.register("before-parse.s3.HeadObject", head)
