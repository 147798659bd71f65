"""The content-addressed cache: verified hits, and drift that invalidates its batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.errors import CacheDriftError
from kiln.core.fsutil import sha256_bytes
from kiln.tasks.build.cache import BuildCache


@pytest.fixture
def cache(tmp_path):
    cache = BuildCache(tmp_path / "cache")
    cache.put("batchA", "k1", {"a.cubin": b"one", "a.json": b"{}"})
    cache.put("batchA", "k2", {"b.cubin": b"two"})
    cache.put("batchB", "k3", {"c.cubin": b"three"})
    return cache


def _object(cache, data: bytes):
    sha = sha256_bytes(data)
    return cache.root / "objects" / sha[:2] / sha


def test_hit_returns_verified_bytes_and_miss_returns_none(cache):
    assert cache.get("batchA", "k1").files == {"a.cubin": b"one", "a.json": b"{}"}
    assert cache.get("batchA", "nope") is None
    assert cache.get("batchZ", "k1") is None


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda p: p.write_bytes(b"ONE"), "another sha256"),  # same size, other bytes
        (lambda p: p.write_bytes(b"on"), "has 2 bytes"),  # truncated
        (lambda p: p.unlink(), "is missing"),  # deleted
    ],
)
def test_drift_raises_and_invalidates_the_whole_batch(cache, damage, needle):
    damage(_object(cache, b"one"))
    with pytest.raises(CacheDriftError, match=needle) as info:
        cache.get("batchA", "k1")
    assert "invalidated batch batchA (2 entries)" in str(info.value)
    assert info.value.retryable
    # the sibling entry of the same batch is gone too; the other batch is intact
    assert cache.get("batchA", "k2") is None
    assert cache.get("batchB", "k3").files == {"c.cubin": b"three"}
    # a rebuild stores a fresh entry that hits again
    cache.put("batchA", "k1", {"a.cubin": b"one", "a.json": b"{}"})
    assert cache.get("batchA", "k1").files["a.cubin"] == b"one"


def test_unreadable_entry_is_drift(cache):
    (cache.root / "entries" / "batchB" / "k3.json").write_text("{not json")
    with pytest.raises(CacheDriftError, match="unreadable"):
        cache.get("batchB", "k3")
    assert not (cache.root / "entries" / "batchB").exists()


def test_verify_reports_the_event_and_leaves_healthy_batches(cache):
    assert cache.verify("batchA", ["k1", "k2"]) is None
    _object(cache, b"two").write_bytes(b"tw0")
    event = cache.verify("batchA", ["k1", "k2"])
    assert event is not None and "drift in entry k2" in event
    assert cache.get("batchA", "k1") is None
    assert cache.verify("batchB", ["k3"]) is None


def test_an_entry_records_what_built_it(cache):
    cache.put("batchC", "k4", {"d.cubin": b"four"}, {"unit": "k/sm_90", "toolchain": "nvcc 13.0"})
    entry = json.loads((cache.root / "entries" / "batchC" / "k4.json").read_text())
    assert entry["info"] == {"unit": "k/sm_90", "toolchain": "nvcc 13.0"}
    assert json.loads((cache.root / "entries" / "batchB" / "k3.json").read_text())["info"] == {}


def test_invalidating_a_batch_that_is_gone_removes_nothing(cache, monkeypatch):
    assert cache.invalidate_batch("batchZ") == 0
    # another process renamed the batch away between our check and our rename
    def raced(self: Path, target: Path) -> Path:
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(Path, "rename", raced)
    assert cache.invalidate_batch("batchA") == 0
    monkeypatch.undo()
    assert cache.invalidate_batch("batchA") == 2
