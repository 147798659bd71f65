"""The one compare-and-swap loop (core/swap.py) that pages, run records and restores share."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConflictError
from kiln.core.store import LocalStore
from kiln.core.swap import BACKOFF_BASE, CAS_ATTEMPTS, put_until_swapped, until_swapped


class RacedStore(LocalStore):
    """A real LocalStore where another writer changes the key between our read and our swap, ``races`` times."""

    def __init__(self, root, races: int) -> None:
        super().__init__(root)
        self.races = races

    def put_page(self, key, data, content_type, cache_control, expected_etag):
        if self.races:
            self.races -= 1
            current = self.get_page(key)
            super().put_page(key, b"theirs %d" % self.races, content_type, cache_control,
                             None if current is None else current[1])
        return super().put_page(key, data, content_type, cache_control, expected_etag)


def test_a_lost_race_is_reread_and_retried_with_growing_backoff(tmp_path):
    store, sleeps = RacedStore(tmp_path, races=3), []
    assert put_until_swapped(store, "p/index.html", b"ours", "text/html", "no-cache", sleeps.append) is True
    assert store.get("p/index.html") == b"ours"
    assert len(sleeps) == 3
    for attempt, slept in enumerate(sleeps):
        assert BACKOFF_BASE[0] * 2**attempt <= slept <= BACKOFF_BASE[1] * 2**attempt


def test_the_retries_are_bounded_and_the_error_names_the_key(tmp_path):
    store, sleeps = RacedStore(tmp_path, races=CAS_ATTEMPTS), []
    with pytest.raises(ConflictError, match=r"p/index.json: still changing after 8 attempts"):
        put_until_swapped(store, "p/index.json", b"ours", "application/json", "no-cache", sleeps.append)
    assert len(sleeps) == CAS_ATTEMPTS - 1  # no pointless wait after the last attempt
    assert store.get("p/index.json") != b"ours"


def test_bytes_already_there_are_not_written_again(tmp_path):
    store = LocalStore(tmp_path)
    store.put_page("k", b"same", "text/plain", "no-cache", None)
    etag = store.get_page("k")[1]
    assert put_until_swapped(store, "k", b"same", "text/plain", "no-cache", lambda _: None) is False
    assert store.get_page("k")[1] == etag


def test_an_error_other_than_a_lost_race_is_not_retried():
    calls = []

    def attempt():
        calls.append(1)
        raise PermissionError("denied")

    with pytest.raises(PermissionError):
        until_swapped("k", attempt, lambda _: None)
    assert calls == [1]
