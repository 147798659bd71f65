"""StagingStore (dry runs): reads fall through to the target, writes land in staging only, same checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import ConflictError, IntegrityError
from kiln.core.fsutil import sha256_bytes
from kiln.core.store import LocalStore
from kiln.release.stores.staging import StagingStore


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def target(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "target")
    store.put_immutable("p/w.whl", b"wheel", "application/octet-stream", "no-cache")
    store.put_page("p/index.json", b"{}", "application/json", "no-cache", None)
    return store


def test_an_immutable_key_the_target_holds_is_checked_against_it_and_never_staged(
    target: LocalStore, tmp_path: Path
) -> None:
    staging = StagingStore(target, tmp_path / "staging")
    info = staging.put_immutable("p/w.whl", b"wheel", "application/octet-stream", "no-cache")
    assert info.sha256 == sha256_bytes(b"wheel")
    with pytest.raises(IntegrityError, match="p/w.whl"):
        staging.put_immutable("p/w.whl", b"other", "application/octet-stream", "no-cache")
    assert not (tmp_path / "staging").exists() or _files(tmp_path / "staging") == {}
    assert target.get("p/w.whl") == b"wheel"


def test_staged_pages_take_compare_and_swap_on_their_own_etag_and_leave_the_target_alone(
    target: LocalStore, tmp_path: Path
) -> None:
    before = _files(tmp_path / "target")
    staging = StagingStore(target, tmp_path / "staging")
    etag = staging.get_page("p/index.json")[1]
    staging.put_page("p/index.json", b'{"a": 1}', "application/json", "no-cache", etag)
    with pytest.raises(ConflictError):
        staging.put_page("p/index.json", b'{"b": 2}', "application/json", "no-cache", etag)
    data, etag = staging.get_page("p/index.json")
    assert data == b'{"a": 1}'
    staging.put_page("p/index.json", b'{"c": 3}', "application/json", "no-cache", etag)
    assert staging.get("p/index.json") == b'{"c": 3}' and staging.head("p/index.json").size == len(b'{"c": 3}')
    assert _files(tmp_path / "target") == before
    assert staging.list("p/") == ["p/index.json", "p/w.whl"]
