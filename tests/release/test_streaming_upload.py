"""Publishing streams a wheel end to end: hashed, read for METADATA and sent without ever being held whole.

Both backends run for real: a local directory, and moto's S3 server over loopback HTTP. For the memory
test the S3 server runs in a process of its own: the session's server lives in the test process and keeps
every object it is sent in memory, which tracemalloc would count as the publisher's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from kiln.core.errors import AlreadyPublishedError, IntegrityError
from kiln.core.fsutil import sha256_file
from kiln.core.manifest import RunManifest
from kiln.core.objects import ObjectInfo, Store
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.release.publish.plan import Plan, Upload, UploadResult
from kiln.release.publish.protocol import PublishRequest, PublishSteps, UploadStep, publish, upload_each
from kiln.release.stores.staging import StagingStore
from tests.helpers.faults import ForwardingStore
from tests.helpers.s3 import S3_ENV
from tests.helpers.wheelkit import make_wheel

from .test_publish_local import page_keys

REPO = Path(__file__).resolve().parents[2]
BLOB = 48 << 20  # incompressible bytes in the big wheel: far more than a streaming publish may hold
CHUNK = 1 << 20
KEY = "nightly/cpu/simple/big/big-1.0-py3-none-any.whl"
_SERVER = """
import sys
from tests.helpers.s3 import moto_s3_server
with moto_s3_server() as url:
    print(url, flush=True)
    sys.stdin.read()  # serves until the test closes the pipe
"""


def _run_with(root: Path, payload: str = "", blob: int = 0) -> RunManifest:
    """A saved run with one cpu wheel ``big 1.0``; ``blob`` random bytes stored (uncompressed) in it as a member.

    The blob is streamed into the zip, never held whole, and RECORD does not list it: publishing reads only
    METADATA (the build checked RECORD).
    """
    wheel = make_wheel(root / "wheels" / "cpu", "big", "1.0", payload=payload)
    if blob:
        with zipfile.ZipFile(wheel, "a") as archive, archive.open(zipfile.ZipInfo("big/blob.bin"), "w") as out:
            for _ in range(blob // CHUNK):
                out.write(os.urandom(CHUNK))
    run = RunManifest(root=root, run_id=uuid.uuid4().hex, flow="test")
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    run.save()
    return run


def _wheel(run: RunManifest) -> Path:
    return run.root / run.artifacts[0].path


def _publish(run: RunManifest, store: Store, upload: UploadStep = upload_each) -> Plan:
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]),
                   PublishSteps(upload=upload, clock=lambda: 1_700_000_000.0))


@pytest.fixture(scope="module")
def s3_elsewhere() -> Iterator[str]:
    """The URL of a moto S3 server running in a process of its own."""
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=env)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), "moto's S3 server did not start"
        yield url
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A fresh, empty target of each backend."""
    if request.param == "local":
        return LocalStore(tmp_path / "target")
    endpoint = request.getfixturevalue("s3_elsewhere")
    session = boto3.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                            region_name=S3_ENV["AWS_DEFAULT_REGION"])
    client = make_client(session, "us-east-1", endpoint)
    bucket = f"kiln-stream-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return S3Store(client, bucket, "site")


def test_publishing_a_large_wheel_holds_a_small_fraction_of_it_in_memory(store: Store, tmp_path: Path) -> None:
    run = _run_with(tmp_path / "run", blob=BLOB)
    size = _wheel(run).stat().st_size
    tracemalloc.start()
    try:
        plan = _publish(run, store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.keys("added") == [KEY]
    assert peak < size // 4, f"publishing a {size}-byte wheel to {store.url} peaked at {peak} bytes traced"
    published = store.head(KEY)
    assert published is not None and (published.sha256, published.size) == (sha256_file(_wheel(run)), size)


class _ChangesTheWheelFirst(ForwardingStore):
    """Fault injection: a real store, but the wheel's file is changed after the publish hashed it, just before
    the store reads it (another process rewriting the build output)."""

    def put_immutable_file(self, key: str, path: Path, sha256: str, content_type: str,
                           cache_control: str) -> ObjectInfo:
        with open(path, "r+b") as handle:
            handle.seek(0, os.SEEK_END)
            handle.write(b"appended later")
        return self.inner.put_immutable_file(key, path, sha256, content_type, cache_control)


def test_a_wheel_changed_after_it_was_hashed_is_an_integrity_error_and_nothing_is_listed(
    store: Store, tmp_path: Path
) -> None:
    with pytest.raises(IntegrityError, match="big-1.0-py3-none-any.whl"):
        _publish(_run_with(tmp_path / "run"), _ChangesTheWheelFirst(store))
    assert page_keys(store) == []
    if isinstance(store, LocalStore):  # checked on the staged copy: not even the wheel's key was created
        assert store.list() == []


def test_a_wheel_changed_after_it_was_verified_is_an_integrity_error_before_any_write(
    store: Store, tmp_path: Path
) -> None:
    def change_then_upload(target: Store, uploads: list[Upload]) -> list[UploadResult]:
        with open(uploads[0].source, "ab") as handle:  # fault injection: rewritten between collect and upload
            handle.write(b"appended later")
        return upload_each(target, uploads)

    with pytest.raises(IntegrityError, match="changed after it was verified"):
        _publish(_run_with(tmp_path / "run"), store, upload=change_then_upload)
    assert store.list() == []


def test_other_bytes_under_the_wheels_key_are_a_conflict_and_the_wheel_is_not_listed(
    store: Store, tmp_path: Path
) -> None:
    _publish(_run_with(tmp_path / "first", payload="first"), store)
    before = store.head(KEY)
    plan = _publish(_run_with(tmp_path / "second", payload="second"), store)
    assert [(r.upload.key, r.outcome) for r in plan.results] == [(KEY, "conflict")]
    assert f"{KEY} already holds sha256 {before.sha256 if before else None}" in plan.results[0].message
    assert store.head(KEY) == before and plan.pages == []


@pytest.mark.parametrize("kind", ["store", "staging"])
def test_put_immutable_file_creates_once_same_bytes_succeed_other_bytes_or_a_wrong_hash_are_refused(
    store: Store, tmp_path: Path, kind: str
) -> None:
    target: Store = store if kind == "store" else StagingStore(store, tmp_path / "staging")
    one, two = tmp_path / "one.whl", tmp_path / "two.whl"
    one.write_bytes(b"one" * 1000)
    two.write_bytes(b"two" * 1000)
    first = target.put_immutable_file("p/w.whl", one, sha256_file(one), "application/octet-stream", "immutable")
    again = target.put_immutable_file("p/w.whl", one, sha256_file(one), "application/octet-stream", "immutable")
    assert first.created and not again.created and first.sha256 == again.sha256 == sha256_file(one)
    assert first.size == 3000
    with pytest.raises(AlreadyPublishedError):
        target.put_immutable_file("p/w.whl", two, sha256_file(two), "application/octet-stream", "immutable")
    with pytest.raises(IntegrityError, match="p/x.whl"):  # the caller's hash is not the file's
        target.put_immutable_file("p/x.whl", two, sha256_file(one), "application/octet-stream", "immutable")
    assert target.get("p/w.whl") == b"one" * 1000
