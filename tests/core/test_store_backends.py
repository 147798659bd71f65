"""The store seam: a kind of store is one backend in core/store.py's table, and code asks the table about a URL.

``test-remote://`` is a fake registered by these tests alone (a local directory
that calls itself remote), so the table's answers can be seen to come from the
entry, not from a scheme spelled somewhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.steps import STEPS
from kiln.core.store import BACKENDS, LocalStore, Store, StoreBackend, backend_for, is_remote, open_store
from kiln.tasks.project.config_permissions import s3_locations

FAKE = "test-remote"


def _open_fake(url: str, *, root: Path, public: bool = False, **_: Any) -> Store:
    return LocalStore(root / url[len(f"{FAKE}://"):], public)


@pytest.fixture
def fake_backend() -> Iterator[StoreBackend]:
    backend = StoreBackend(FAKE, _open_fake, remote=True)
    BACKENDS[FAKE] = backend  # the one table entry a new kind of store adds
    try:
        yield backend
    finally:
        del BACKENDS[FAKE]


@pytest.mark.parametrize(("url", "remote"), [
    ("s3://bucket/prefix", True), ("file:///srv/index", False), ("file://relative", False),
    ("https://example.org/simple/", False), ("/plain/path", False), ("", False),
])
def test_is_remote_is_the_backends_answer_and_false_for_urls_that_are_not_a_stores(url, remote):
    assert is_remote(url) is remote


def test_an_unknown_scheme_is_refused_naming_the_url_and_the_schemes(tmp_path):
    with pytest.raises(InvalidInputError, match=r"store URL 'gs://b/p': scheme must be one of \['file://', 's3://'\]"):
        open_store("gs://b/p", root=tmp_path)
    assert backend_for("s3://b").scheme == "s3" and backend_for("file:///x").remote is False


def test_a_backend_registered_in_the_table_is_opened_and_treated_as_remote_without_other_edits(
        fake_backend, tmp_path):
    store = open_store(f"{FAKE}://team-store", root=tmp_path)
    store.put_immutable("a/b.txt", b"bytes", "text/plain", "no-cache")
    assert (tmp_path / "team-store" / "a" / "b.txt").read_bytes() == b"bytes"
    assert backend_for(f"{FAKE}://x") is fake_backend and is_remote(f"{FAKE}://x")
    # a step that reaches a remote store needs credentials of its own (kiln.toml's [permissions.<step>])
    assert s3_locations(STEPS[0], f"{FAKE}://artifacts", ()) == [f"{FAKE}://artifacts"]
    assert s3_locations(STEPS[0], "file:///local", ()) == []


def test_every_backend_has_its_url_check_and_a_target_of_a_registered_store_loads_with_its_scheme_as_kind(
        fake_backend, monkeypatch):
    from kiln.tasks.project import config_fields
    from kiln.tasks.project.config_publish import Target

    assert set(config_fields.URL_CHECKS) == set(BACKENDS) - {FAKE}  # every real store's URL is checked by its own
    with pytest.raises(ValueError, match=rf"'{FAKE}://idx' must start with one of file://, s3://, {FAKE}://"):
        Target(url=f"{FAKE}://idx")  # registered, but its URL has no check yet: refused, never taken unchecked
    monkeypatch.setitem(config_fields.URL_CHECKS, FAKE, lambda value: value)  # the one line a new store adds there
    target = Target(url=f"{FAKE}://idx")
    assert target.kind == FAKE and Target(url="s3://bucket/p").kind == "s3"
    with pytest.raises(ValueError, match="public applies to file:// targets only"):
        Target(url=f"{FAKE}://idx", public=True)  # a remote store's readers are its policy's business
