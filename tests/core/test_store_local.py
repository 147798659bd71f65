"""LocalStore: create-only and compare-and-swap semantics, key validation."""

from __future__ import annotations

import multiprocessing
import os
import re
from pathlib import Path

import pytest

from kiln.core.errors import ConflictError, IntegrityError, InvalidInputError
from kiln.core.fsutil import sha256_bytes
from kiln.core.store import LocalStore, check_key, open_store


def test_open_store_resolves_relative_file_urls_against_root(tmp_path: Path) -> None:
    store = open_store("file://sub/dir", root=tmp_path)
    store.put_immutable("a.txt", b"x", "text/plain", "no-cache")
    assert (tmp_path / "sub" / "dir" / "a.txt").read_bytes() == b"x"


def test_open_store_keeps_absolute_file_urls(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/abs", root=Path("/nonexistent"))
    store.put_immutable("k", b"1", "text/plain", "no-cache")
    assert (tmp_path / "abs" / "k").read_bytes() == b"1"


def test_open_store_refuses_unknown_scheme(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="ftp://x"):
        open_store("ftp://x", root=tmp_path)


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../b", "a//b", "a\\b", "a/\nb", "./a", "a/\x7f", "a\x1fb",
                                 b"a.whl", 7])
def test_check_key_refuses_escaping_or_control_keys(key: str) -> None:
    with pytest.raises(InvalidInputError):
        check_key(key)


def test_check_key_accepts_printable_keys_up_to_the_first_control_character() -> None:
    assert check_key("p/a b~+.whl") == "p/a b~+.whl"  # space (32) is the first printable character


@pytest.mark.parametrize("url", ["file://a\x1fb", "file://a\nb", "file://"])
def test_open_store_refuses_a_file_url_with_a_control_character_or_no_directory(tmp_path: Path, url: str) -> None:
    with pytest.raises(InvalidInputError, match="store URL"):
        open_store(url, root=tmp_path)


def test_open_store_accepts_a_file_url_with_a_space(tmp_path: Path) -> None:
    open_store("file://with space", root=tmp_path).put_immutable("k", b"1", "text/plain", "no-cache")
    assert (tmp_path / "with space" / "k").read_bytes() == b"1"


def test_put_page_creates_missing_parent_directories(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "fresh")
    store.put_page("nightly/cu130/simple/p/index.json", b"{}", "application/json", "max-age=60", None)
    assert store.get("nightly/cu130/simple/p/index.json") == b"{}"


def test_put_immutable_same_bytes_is_success_other_bytes_integrity_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    first = store.put_immutable("w/a.whl", b"abc", "application/octet-stream", "immutable")
    again = store.put_immutable("w/a.whl", b"abc", "application/octet-stream", "immutable")
    assert first == again and first.sha256 == sha256_bytes(b"abc")
    # the publisher looks up a present wheel's sidecar only when its own write did not create the wheel
    assert first.created is True and again.created is False
    with pytest.raises(IntegrityError, match="immutable"):
        store.put_immutable("w/a.whl", b"abd", "application/octet-stream", "immutable")
    assert (tmp_path / "w" / "a.whl").read_bytes() == b"abc"
    assert store.list() == ["w/a.whl"]  # no temp files left behind


def test_put_immutable_with_bad_key_writes_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    with pytest.raises(InvalidInputError):
        store.put_immutable("../evil", b"x", "text/plain", "no-cache")
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "root").exists() or store.list() == []


def test_put_page_compare_and_swap(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    created = store.put_page("p/index.html", b"v1", "text/html", "max-age=60", expected_etag=None)
    with pytest.raises(ConflictError):
        store.put_page("p/index.html", b"v2", "text/html", "max-age=60", expected_etag=None)
    store.put_page("p/index.html", b"v2", "text/html", "max-age=60", expected_etag=created.etag)
    with pytest.raises(ConflictError):  # stale ETag: the page moved on to v2
        store.put_page("p/index.html", b"v3", "text/html", "max-age=60", expected_etag=created.etag)
    assert store.get_page("p/index.html") == (b"v2", sha256_bytes(b"v2"))


def test_head_and_get_of_missing_key_are_none(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert store.get("missing") is None and store.head("missing") is None and store.get_page("x/y") is None


def _race(root: str, n: int, results: multiprocessing.Queue[str]) -> None:
    store = LocalStore(Path(root))
    try:
        store.put_immutable("same.whl", bytes([n]) * 1000, "application/octet-stream", "immutable")
        results.put("ok")
    except IntegrityError:
        results.put("integrity")


def test_concurrent_create_only_writers_one_wins_other_gets_integrity_error(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), n, results)) for n in (1, 2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    outcome = sorted(results.get(timeout=5) for _ in procs)
    assert outcome == ["integrity", "ok"]
    assert (tmp_path / "same.whl").read_bytes() in (b"\x01" * 1000, b"\x02" * 1000)


def test_list_walks_only_the_prefix_directory_and_matches_a_partial_last_part(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "s")
    for key in ("runs/abc/units/u1.json", "runs/abc/units/u2.json", "runs/abd/units/u1.json", "runs/xyz/units/u.json",
                "top.json"):
        store.put_immutable(key, b"{}", "application/json", "no-cache")
    assert store.list("runs/abc/units/") == ["runs/abc/units/u1.json", "runs/abc/units/u2.json"]
    assert store.list("runs/ab") == ["runs/abc/units/u1.json", "runs/abc/units/u2.json", "runs/abd/units/u1.json"]
    assert store.list("runs/none/") == []
    assert len(store.list()) == 5
    # Spied on, not replaced: the walk still runs; only where it starts is checked.
    import os

    tops: list[str] = []
    real_walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: (tops.append(str(top)), real_walk(top, *a, **k))[1])
    store.list("runs/abc/units/")
    assert tops == [str(store.root / "runs" / "abc" / "units")]


@pytest.mark.parametrize("durable", [True, False])
def test_an_atomic_write_replaces_whole_and_fsyncs_only_when_durable(tmp_path, monkeypatch, durable):
    from kiln.core import fsutil

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])  # a spy, not a fake
    target = tmp_path / "view" / "unit.cubin"
    fsutil.atomic_write_bytes(target, b"old", durable=durable)
    fsutil.atomic_write_bytes(target, b"new bytes", durable=durable)
    assert target.read_bytes() == b"new bytes"
    assert [p.name for p in target.parent.iterdir()] == ["unit.cubin"]  # no temporary file left behind
    assert len(synced) == (2 if durable else 0)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_local_store_is_owner_only_from_its_first_write(tmp_path: Path) -> None:
    store = open_store("file://artifacts", root=tmp_path)
    store.put_immutable("runs/r1/wheel.whl", b"w", "application/octet-stream", "no-cache")
    assert _mode(tmp_path / "artifacts") == 0o700


def test_an_existing_store_root_others_may_read_is_closed_by_its_owner(tmp_path: Path) -> None:
    root = tmp_path / "index"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    LocalStore(root).put_page("simple/index.html", b"<html/>", "text/html", "no-cache", None)
    assert _mode(root) == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777])
def test_a_store_root_others_may_write_into_is_refused_naming_it_before_any_read_or_write(tmp_path: Path,
                                                                                          mode: int) -> None:
    from kiln.core.owneronly import NotOwnerOnlyError

    root = tmp_path / "artifacts"
    (root / "build-ledger").mkdir(parents=True)
    (root / "build-ledger" / "forged.sha256").write_bytes(b"planted by another user")
    os.chmod(root, mode)
    store = open_store(f"file://{root}", root=tmp_path)
    why = f"the store root {root} is refused: its group or every user may write into it (mode {mode:04o})"
    for call in (lambda: store.get("build-ledger/forged.sha256"), lambda: store.list("build-ledger/"),
                 lambda: store.put_immutable("runs/r1/run.json", b"{}", "application/json", "no-cache")):
        with pytest.raises(NotOwnerOnlyError, match=re.escape(why)) as refused:
            call()
        assert "public = true" in str(refused.value)
    assert sorted(p.name for p in root.iterdir()) == ["build-ledger"] and _mode(root) == mode & 0o777
    public = open_store(f"file://{root}", root=tmp_path, public=True)  # shared on purpose: the target says so
    assert public.get("build-ledger/forged.sha256") == b"planted by another user"


def test_a_store_root_another_user_owns_is_refused(tmp_path: Path) -> None:
    from kiln.core.owneronly import NotOwnerOnlyError

    if os.geteuid() == 0:  # as root: a directory of its own given to nobody
        root = tmp_path / "theirs"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
    else:  # as anyone else: a directory root owns
        root = Path("/usr/share")
    with pytest.raises(NotOwnerOnlyError, match=re.escape(f"the store root {root} is refused: it is owned by uid")):
        LocalStore(root).get("simple/index.html")


def test_a_public_store_stays_readable_by_every_local_user(tmp_path: Path) -> None:
    root = tmp_path / "served"
    root.mkdir(mode=0o700)
    store = open_store(f"file://{root}", root=tmp_path, public=True)
    store.put_immutable("simple/demo/demo-1.0-py3-none-any.whl", b"w", "application/octet-stream", "no-cache")
    assert _mode(root) == 0o755


def test_public_is_refused_on_an_s3_target() -> None:
    from pydantic import ValidationError

    from kiln.tasks.project.config import Target

    with pytest.raises(ValidationError, match="public applies to file:// targets only"):
        Target(url="s3://bucket/simple", public=True)
    assert Target(url="file://.kiln/index", public=True).public
