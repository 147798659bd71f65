"""The unit cache's shared tier on a real store (moto's S3 server on loopback, or a shared directory):
one worker's entry is another's verified hit; damaged, forged or unreachable tiers are misses, never errors."""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
from typing import Any

import boto3
import pytest
from botocore.config import Config

from kiln.core.fsutil import sha256_bytes
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.cache_remote import RemoteTier
from tests.helpers.s3 import S3_ENV

_buckets = itertools.count()
FILES = {"add_kernel__fp32.cubin": b"\x7fELF cubin bytes", "add_kernel__fp32.json": b'{"name": "add"}'}


@pytest.fixture
def client(s3_endpoint: str) -> Any:
    session = boto3.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    return make_client(session, "us-east-1", s3_endpoint)


@pytest.fixture
def bucket(client: Any) -> str:
    name = f"kiln-cache-{os.getpid()}-{next(_buckets)}"
    client.create_bucket(Bucket=name)
    return name


def _tier(client: Any, bucket: str, **options: Any) -> RemoteTier:
    return RemoteTier(S3Store(client, bucket, "artifacts"), "build-cache", **options)


def _workers(client: Any, bucket: str, tmp_path, **options: Any) -> tuple[BuildCache, BuildCache]:
    """Two workers: each its own local directory, one shared store."""
    return (BuildCache(tmp_path / "w1", _tier(client, bucket)),
            BuildCache(tmp_path / "w2", _tier(client, bucket, **options)))


def _object_key(data: bytes) -> str:
    return f"artifacts/build-cache/objects/{sha256_bytes(data)}"


def test_a_second_worker_hits_what_the_first_stored_and_keeps_it_locally(client, bucket, tmp_path):
    first, second = _workers(client, bucket, tmp_path)
    first.put("batch", "k1", FILES, {"unit": "build/cu130/9.0/add"})
    assert first.remote is not None and first.remote.stats.written == 1
    hit = second.get("batch", "k1")
    assert hit is not None and hit.files == FILES
    assert second.remote is not None and second.remote.stats.hits == 1
    # now in the second worker's own tier: served without the store
    assert BuildCache(tmp_path / "w2").get("batch", "k1").files == FILES  # type: ignore[union-attr]
    assert second.get("batch", "other") is None and second.remote.stats.misses == 1


def test_objects_are_created_once_under_their_hash(client, bucket, tmp_path):
    first, second = _workers(client, bucket, tmp_path)
    first.put("batch", "k1", FILES)
    second.put("batch", "k2", FILES)  # the same bytes under another key: the objects are already there
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted([*(_object_key(d) for d in FILES.values()),
                           "artifacts/build-cache/entries/batch/k1.json", "artifacts/build-cache/entries/batch/k2.json"])


@pytest.mark.parametrize("damage", ["truncated", "other bytes", "missing"])
def test_a_damaged_shared_object_is_a_miss_and_the_rebuild_is_served_locally(client, bucket, tmp_path, damage,
                                                                              caplog):
    first, second = _workers(client, bucket, tmp_path)
    first.put("batch", "k1", FILES)
    key = _object_key(FILES["add_kernel__fp32.cubin"])
    if damage == "missing":
        client.delete_object(Bucket=bucket, Key=key)
    else:  # a torn upload or a forger writing around the create-only protocol
        client.put_object(Bucket=bucket, Key=key, Body=b"\x7fELF" if damage == "truncated" else b"\x7fELF CUBIN BYTES")
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.cache_remote"):
        assert second.get("batch", "k1") is None
    assert second.remote is not None and second.remote.stats.rejected == 1
    assert "refused" in caplog.text and "built again" in caplog.text
    second.put("batch", "k1", FILES)  # the rebuild: kept locally, the shared tier keeps its own (create-only)
    assert second.get("batch", "k1").files == FILES  # type: ignore[union-attr]


@pytest.mark.parametrize("entry", [
    {"files": {"../../escape.so": {"sha256": "0" * 64, "size": 1}}},  # a name outside the unit's directory
    {"files": {"a.so": {"sha256": "not-a-hash", "size": 1}}},
    {"files": {"a.so": {"sha256": "0" * 64, "size": -1}}},
    {"files": ["a.so"]},
    "not an entry",
])
def test_a_forged_entry_is_a_miss(client, bucket, tmp_path, entry):
    _, second = _workers(client, bucket, tmp_path)
    client.put_object(Bucket=bucket, Key="artifacts/build-cache/entries/batch/k1.json", Body=json.dumps(entry))
    assert second.get("batch", "k1") is None
    assert second.remote is not None and second.remote.stats.rejected == 1
    assert not (tmp_path / "escape.so").exists()


def test_a_forged_object_under_a_hash_is_a_miss_however_well_its_entry_agrees(client, bucket, tmp_path):
    """A forger may write an entry and an object; the object's name is the hash it must have."""
    _, second = _workers(client, bucket, tmp_path)
    claimed = sha256_bytes(b"what the sources compile to")
    forged = b"a planted binary"
    client.put_object(Bucket=bucket, Key=f"artifacts/build-cache/objects/{claimed}", Body=forged)
    entry = {"files": {"k.so": {"sha256": claimed, "size": len(forged)}}}
    client.put_object(Bucket=bucket, Key="artifacts/build-cache/entries/batch/k1.json", Body=json.dumps(entry))
    assert second.get("batch", "k1") is None
    assert second.remote is not None and second.remote.stats.rejected == 1


def test_a_read_only_tier_reads_and_never_writes(client, bucket, tmp_path):
    first, reader = _workers(client, bucket, tmp_path, read_only=True)
    first.put("batch", "k1", FILES)
    assert reader.get("batch", "k1").files == FILES  # type: ignore[union-attr]
    reader.put("batch", "k2", {"other.so": b"untrusted branch"})
    assert client.list_objects_v2(Bucket=bucket, Prefix="artifacts/build-cache/entries/batch/k2").get("KeyCount") == 0
    assert reader.get("batch", "k2").files == {"other.so": b"untrusted branch"}  # type: ignore[union-attr]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_store_is_one_warning_and_a_local_only_cache(tmp_path, caplog):
    # One attempt per call: botocore's own backoff (about 25 s for a refused port) is not what this tests.
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{_closed_port()}",
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2))
    cache = BuildCache(tmp_path / "w", _tier(client, "nowhere"))
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.cache_remote"):
        assert cache.get("batch", "k1") is None
        cache.put("batch", "k1", FILES)
        assert cache.get("batch", "k1").files == FILES  # type: ignore[union-attr]
    assert cache.remote is not None and cache.remote.stats.unreachable
    assert caplog.text.count("did not answer") == 1


def test_a_shared_directory_is_a_tier_too(tmp_path):
    shared = LocalStore(tmp_path / "shared")
    first = BuildCache(tmp_path / "w1", RemoteTier(shared))
    second = BuildCache(tmp_path / "w2", RemoteTier(shared))
    first.put("batch", "k1", FILES)
    assert second.get("batch", "k1").files == FILES  # type: ignore[union-attr]
    obj = tmp_path / "shared" / "build-cache" / "objects" / sha256_bytes(FILES["add_kernel__fp32.cubin"])
    obj.chmod(0o600)
    obj.write_bytes(b"torn")
    assert BuildCache(tmp_path / "w3", RemoteTier(shared)).get("batch", "k1") is None


def test_a_store_that_refuses_writes_is_read_and_never_fails_the_build(tmp_path, caplog):
    """A role without the prefix's write right (here a store open read-only): reads go on, writes stop."""
    from kiln.release.stores.readonly import ReadOnlyStore

    shared = LocalStore(tmp_path / "shared")
    BuildCache(tmp_path / "w1", RemoteTier(shared)).put("batch", "k1", FILES)
    reader = BuildCache(tmp_path / "w2", RemoteTier(ReadOnlyStore(shared, "the test role reads only")))
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.cache_remote"):
        reader.put("batch", "k2", {"other.so": b"built here"})
        reader.put("batch", "k3", {"third.so": b"built here too"})
    assert caplog.text.count("refused a write") == 1
    assert reader.remote is not None and reader.remote.read_only and reader.remote.answering
    assert reader.get("batch", "k1").files == FILES  # type: ignore[union-attr]
    assert not any(k.startswith("build-cache/entries/batch/k2") for k in shared.list("build-cache/"))
