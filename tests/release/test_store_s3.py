"""S3Store against moto's S3 server on loopback: conditional writes, checksums, typed errors."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from kiln.core.errors import (
    AccessDeniedError,
    AlreadyPublishedError,
    ConflictError,
    IntegrityError,
    InvalidInputError,
    PermanentError,
    ThrottledError,
    TransientStoreError,
    is_retryable,
)
from kiln.core.fsutil import sha256_bytes
from kiln.core.s3 import S3Store, make_client, translate
from kiln.core.store import open_store
from tests.helpers.faults import echo_checksums


def test_put_immutable_sets_content_type_cache_control_and_reads_hash_back(s3_store: S3Store) -> None:
    info = s3_store.put_immutable("p/a-1.0+cu130-py3-none-any.whl", b"wheel", "application/octet-stream",
                                  "public, max-age=31536000, immutable")
    assert info.sha256 == sha256_bytes(b"wheel")
    raw = s3_store.client.head_object(Bucket=s3_store.bucket, Key="simple/p/a-1.0+cu130-py3-none-any.whl")
    assert raw["ContentType"] == "application/octet-stream"
    assert raw["CacheControl"] == "public, max-age=31536000, immutable"
    assert s3_store.list("p/") == ["p/a-1.0+cu130-py3-none-any.whl"]


def test_put_immutable_same_bytes_succeeds_other_bytes_is_integrity_error(s3_store: S3Store) -> None:
    s3_store.put_immutable("k.whl", b"one", "application/octet-stream", "immutable")
    one = s3_store.put_immutable("k.whl", b"one", "application/octet-stream", "immutable")
    assert one.sha256 == sha256_bytes(b"one")
    with pytest.raises(IntegrityError, match="immutable") as caught:
        s3_store.put_immutable("k.whl", b"two", "application/octet-stream", "immutable")
    assert not is_retryable(caught.value)
    assert s3_store.get("k.whl") == b"one"


def test_put_page_is_compare_and_swap_on_etag(s3_store: S3Store) -> None:
    first = s3_store.put_page("p/index.html", b"v1", "text/html", "max-age=60", None)
    with pytest.raises(ConflictError):
        s3_store.put_page("p/index.html", b"x", "text/html", "max-age=60", None)
    data, etag = s3_store.get_page("p/index.html")  # type: ignore[misc]
    assert (data, etag) == (b"v1", first.etag)
    s3_store.put_page("p/index.html", b"v2", "text/html", "max-age=60", etag)
    with pytest.raises(ConflictError):
        s3_store.put_page("p/index.html", b"v3", "text/html", "max-age=60", etag)
    assert s3_store.get("p/index.html") == b"v2"


def test_missing_objects_are_none(s3_store: S3Store) -> None:
    assert s3_store.get("nope") is None and s3_store.head("nope") is None and s3_store.get_page("a/b") is None


def test_expected_bucket_owner_is_sent_on_every_call(s3_endpoint: str, s3_session: Any, s3_bucket: str) -> None:
    client = make_client(s3_session, "us-east-1", s3_endpoint)
    seen: list[tuple[str, Any]] = []
    client.meta.events.register(
        "before-parameter-build.s3.*",
        lambda params, event_name, **_: seen.append((event_name, params.get("ExpectedBucketOwner"))),
    )
    store = S3Store(client, s3_bucket, "x", expected_owner="123456789012")
    store.put_immutable("a", b"1", "text/plain", "immutable")
    store.put_page("b", b"2", "text/html", "no-cache", None)
    store.get("a"), store.head("a"), store.list()
    assert len(seen) >= 5 and all(owner == "123456789012" for _, owner in seen)


def test_open_store_builds_an_s3_store_for_s3_urls(s3_endpoint: str, s3_session: Any, s3_bucket: str, tmp_path) -> None:
    store = open_store(f"s3://{s3_bucket}/a/b", root=tmp_path, region="us-east-1", endpoint=s3_endpoint,
                       session=s3_session)
    store.put_immutable("k", b"v", "text/plain", "immutable")
    assert store.list() == ["k"] and store.url == f"s3://{s3_bucket}/a/b"


def test_open_store_refuses_traversal_in_prefix(tmp_path) -> None:
    with pytest.raises(InvalidInputError):
        open_store("s3://bucket/a/../b", root=tmp_path)


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, ThrottledError),
        ("InternalError", 500, TransientStoreError),
        ("AccessDenied", 403, AccessDeniedError),
        ("BadDigest", 400, IntegrityError),
        ("PreconditionFailed", 412, ConflictError),
        ("NoSuchBucket", 404, InvalidInputError),
        ("SomethingNew", 400, PermanentError),
    ],
)
def test_translate_maps_botocore_errors_to_typed_errors_keeping_the_cause(code: str, status: int, kind: type) -> None:
    cause = _client_error(code, status)
    with pytest.raises(kind, match=code) as caught:
        translate(cause, "put_object s3://b/k")
    assert type(caught.value) is kind and caught.value.__cause__ is cause


def test_translate_makes_connection_errors_retryable() -> None:
    with pytest.raises(TransientStoreError) as caught:
        translate(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), "get")
    assert is_retryable(caught.value)


def test_access_denied_from_the_server_is_permanent(s3_store: S3Store) -> None:
    # Fault injector: moto grants everything, so answer one call with a 403 the way S3 would.
    def deny(request: Any, **_: Any) -> AWSResponse:
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        return AWSResponse(request.url, 403, {}, _Raw(body))

    s3_store.client.meta.events.register_first("before-send.s3.PutObject", deny)
    with pytest.raises(AccessDeniedError, match="AccessDenied"):
        s3_store.put_page("p", b"x", "text/html", "no-cache", None)


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any):
        yield self._body


class _FailingRaw:
    """A response body whose connection breaks while it is read."""

    def __init__(self, error: Exception) -> None:
        self.error, self.closed = error, False

    def read(self, *_: Any, **__: Any) -> bytes:
        raise self.error

    def stream(self, **_: Any):
        raise self.error

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("error", [ConnectionResetError("reset by peer"), ReadTimeoutError(endpoint_url="http://s3")],
                         ids=["connection-reset", "read-timeout"])
def test_a_body_that_breaks_while_read_is_a_retryable_store_error(s3_store: S3Store, error: Exception) -> None:
    s3_store.put_page("p/index.json", b"{}", "application/json", "no-cache", None)

    raw = _FailingRaw(error)

    # Fault injector: the GET is answered, then its body fails mid-read.
    def broken(request: Any, **_: Any) -> AWSResponse:
        return AWSResponse(request.url, 200, {"Content-Length": "2", "ETag": '"e"'}, raw)

    s3_store.client.meta.events.register_first("before-send.s3.GetObject", broken)
    with pytest.raises(TransientStoreError, match="p/index.json") as caught:
        s3_store.get_page("p/index.json")
    assert is_retryable(caught.value) and caught.value.__cause__ is error
    assert raw.closed  # the broken connection is released, not left to the pool


def test_a_checksum_header_that_is_not_base64_is_ignored_and_the_bytes_are_hashed(s3_store: S3Store) -> None:
    s3_store.put_immutable("w.whl", b"wheel", "application/octet-stream", "immutable")
    s3_store.verifies_checksums = True  # only then does head() trust a HEAD's checksum header at all

    # Fault injector: a HEAD answer whose checksum header is not base64 at all.
    def odd_header(request: Any, **_: Any) -> AWSResponse:
        headers = {"Content-Length": "5", "ETag": '"e"', "x-amz-checksum-sha256": "\u00ff\u00fe=="}
        return AWSResponse(request.url, 200, headers, _Raw(b""))

    s3_store.client.meta.events.register_first("before-send.s3.HeadObject", odd_header)
    assert s3_store.head("w.whl").sha256 == sha256_bytes(b"wheel")


def test_bytes_corrupted_in_transit_are_caught_by_the_read_back(s3_store: S3Store) -> None:
    # Fault injector: flip the body of the PutObject on its way to the server. moto does not
    # check ChecksumSHA256, so only our own read-back of the hash can notice.
    def corrupt(request: Any, **_: Any) -> None:
        body = request.body.read() if hasattr(request.body, "read") else bytes(request.body)
        request.body = b"X" + body[1:]

    s3_store.client.meta.events.register("before-send.s3.PutObject", corrupt)
    with pytest.raises(IntegrityError, match="holds sha256"):
        s3_store.put_immutable("w.whl", b"good bytes", "application/octet-stream", "immutable")


def test_pages_and_wheels_carry_their_content_type_and_cache_control(s3_store: S3Store, tmp_path) -> None:
    from kiln.release.publish.pages import IMMUTABLE_CACHE, PAGE_CACHE
    from kiln.release.publish.protocol import PublishRequest, publish
    from tests.helpers.runkit import make_run

    run = make_run(tmp_path / "run", {"cu130": [("demo", "1.0+cu130")]})
    publish(run, s3_store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]))
    base = "simple/nightly/cu130/simple"
    expected = {
        f"{base}/index.html": ("text/html; charset=utf-8", PAGE_CACHE),
        f"{base}/demo/index.json": ("application/vnd.pypi.simple.v1+json", PAGE_CACHE),
        f"{base}/demo/demo-1.0+cu130-py3-none-any.whl": ("application/octet-stream", IMMUTABLE_CACHE),
        f"{base}/demo/demo-1.0+cu130-py3-none-any.whl.metadata": ("text/plain; charset=utf-8", IMMUTABLE_CACHE),
    }
    for key, (ctype, cache) in expected.items():
        head = s3_store.client.head_object(Bucket=s3_store.bucket, Key=key)
        assert (head["ContentType"], head["CacheControl"]) == (ctype, cache), key


def _requests(client: Any) -> Counter[str]:
    sent: Counter[str] = Counter()
    client.meta.events.register("before-send.s3", lambda event_name, **_: sent.update([event_name.rsplit(".", 1)[-1]]))
    return sent


def _corrupt_puts(client: Any) -> None:
    # Fault injector: flip the first byte of every PutObject body on its way to the server.
    def corrupt(request: Any, **_: Any) -> None:
        body = request.body.read() if hasattr(request.body, "read") else bytes(request.body)
        request.body = b"X" + body[1:]

    client.meta.events.register("before-send.s3.PutObject", corrupt)


def test_create_only_write_makes_no_existence_check_and_reads_back_on_a_store_that_does_not_verify(
    s3_store: S3Store,
) -> None:
    sent = _requests(s3_store.client)
    info = s3_store.put_immutable("w.whl", b"one", "application/octet-stream", "immutable")
    assert info.created and info.sha256 == sha256_bytes(b"one")
    assert sent == {"PutObject": 1, "GetObject": 1}  # the write, then the read-back: no HEAD before
    sent.clear()
    again = s3_store.put_immutable("w.whl", b"one", "application/octet-stream", "immutable")
    assert not again.created and sent == {"PutObject": 1, "GetObject": 1}  # 412, then the bytes hashed
    with pytest.raises(AlreadyPublishedError, match="immutable"):
        s3_store.put_immutable("w.whl", b"two", "application/octet-stream", "immutable")
    assert s3_store.get("w.whl") == b"one"


def test_store_that_verifies_and_confirms_the_checksum_writes_once_without_reading_back(
    s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    client = make_client(s3_session, "us-east-1", s3_endpoint)
    echo_checksums(client)  # simulation: the echo AWS sends after verifying; moto sends none
    sent = _requests(client)
    store = S3Store(client, s3_bucket, "v", verifies_checksums=True)
    info = store.put_immutable("w.whl", b"one", "application/octet-stream", "immutable")
    assert info.created and info.sha256 == sha256_bytes(b"one") and sent == {"PutObject": 1}
    assert not store.put_immutable("w.whl", b"one", "application/octet-stream", "immutable").created
    with pytest.raises(AlreadyPublishedError):
        store.put_immutable("w.whl", b"two", "application/octet-stream", "immutable")


def test_store_set_to_verify_whose_server_does_not_confirm_still_reads_back_and_catches_corruption(
    s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    client = make_client(s3_session, "us-east-1", s3_endpoint)
    _corrupt_puts(client)  # moto neither checks nor echoes the checksum: a misconfigured verifies_checksums
    store = S3Store(client, s3_bucket, "v", verifies_checksums=True)
    with pytest.raises(IntegrityError, match="holds sha256") as caught:
        store.put_immutable("w.whl", b"good bytes", "application/octet-stream", "immutable")
    assert not isinstance(caught.value, AlreadyPublishedError)


def test_verifies_checksums_is_true_on_aws_false_with_an_endpoint_unless_set(
    tmp_path, s3_endpoint: str, s3_session: Any
) -> None:
    def opened(**kw: Any) -> bool:
        store = open_store("s3://bucket/x", root=tmp_path, region="us-east-1", session=s3_session, **kw)
        return store.verifies_checksums

    assert opened() is True
    assert opened(endpoint=s3_endpoint) is False
    assert opened(endpoint=s3_endpoint, verifies_checksums=True) is True
    assert opened(verifies_checksums=False) is False


def test_translate_makes_other_botocore_errors_permanent_and_re_raises_the_rest() -> None:
    from botocore.exceptions import NoCredentialsError

    with pytest.raises(PermanentError) as caught:
        translate(NoCredentialsError(), "put_object s3://b/k")
    assert not is_retryable(caught.value) and "put_object s3://b/k" in str(caught.value)
    bug = ValueError("not a store error")
    with pytest.raises(ValueError) as raised:
        translate(bug, "get")
    assert raised.value is bug  # a bug of ours is not dressed up as a store error


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("", None),
    ("abc-2", None),  # a multipart "checksum of checksums" is not the file's hash
    ("q83vEjRWeJA=", "abcdef1234567890"),
])
def test_only_a_whole_object_checksum_becomes_a_hex_digest(value, expected) -> None:
    from kiln.core.s3 import _b64_to_hex

    assert _b64_to_hex(value) == expected


def test_a_verifying_head_of_a_missing_key_is_none(s3_store: S3Store) -> None:
    s3_store.verifies_checksums = True  # the HEAD with ChecksumMode=ENABLED, as on AWS
    assert s3_store.head("nothing/here.whl") is None


class _CountingBody:
    """Instrumentation: the real response body, recording how much each read asked for (None: all of it)."""

    def __init__(self, body: Any, asked: list[int | None]) -> None:
        self.body, self.asked = body, asked

    def read(self, amt: int | None = None) -> bytes:
        self.asked.append(amt)
        return bytes(self.body.read(amt))

    def __enter__(self) -> _CountingBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.body.close()


def test_a_read_back_hashes_the_object_as_it_streams_never_reading_it_whole(s3_store: S3Store) -> None:
    data = bytes(range(256)) * (3 * 4096) + b"tail..."  # 3 MiB and 7 bytes: several chunks and a short one
    asked: list[int | None] = []

    def count(parsed: dict[str, Any], **_: Any) -> None:
        parsed["Body"] = _CountingBody(parsed["Body"], asked)

    s3_store.client.meta.events.register("after-call.s3.GetObject", count)
    info = s3_store.put_immutable("big.whl", data, "application/octet-stream", "immutable")
    assert info.created and (info.size, info.sha256) == (len(data), sha256_bytes(data))
    assert asked and None not in asked and max(a for a in asked if a is not None) <= 1 << 20
