"""A nightly's per-commit index: only its commit's wheels, linked from the channel, never a second copy."""

from __future__ import annotations

import posixpath
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

from kiln.core.errors import InvalidInputError, TransientStoreError
from kiln.core.fsutil import sha256_bytes
from kiln.core.store import LocalStore, Store
from kiln.release.publish.plan import UploadResult, commit_index_prefix
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish, upload_each
from tests.helpers.faults import HookedLocalStore
from tests.helpers.indexcheck import check_local_index
from tests.helpers.pageparse import parse_html, parse_json
from tests.helpers.runkit import make_run

COMMIT_A, COMMIT_B = "a1b2c3d4e5f6" + "0" * 28, "0123456789ab" + "f" * 28
CLOCK = lambda: 1_700_000_000.0  # noqa: E731 - an injected, fixed clock


def _publish(run, store, commit: str = COMMIT_A, variants=("cpu",), extra=(), upload=upload_each):
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=list(variants),
                                              extra=extra, commit=commit),
                   PublishSteps(upload=upload, clock=CLOCK))


def _json_links(store: Store, page_key: str) -> list[tuple[str, str]]:
    """(key the JSON page's url resolves to, its sha256) of every file the page lists."""
    data = store.get(page_key)
    assert data is not None, f"{page_key} is missing"
    base = posixpath.dirname(page_key) + "/"
    return [(posixpath.normpath(base + unquote(f["url"])), f["hashes"]["sha256"]) for f in parse_json(data)["files"]]


def _versions(store: Store, index: str, project: str = "demo") -> list[str]:
    data = store.get(f"{index}/{project}/index.json")
    return [] if data is None else parse_json(data)["versions"]


def test_two_commits_each_get_an_index_of_their_own_wheels_and_the_channel_lists_both(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    first = _publish(make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")]}), store, COMMIT_A)
    second = _publish(make_run(tmp_path / "b", {"cpu": [("demo", "1.0.dev2")]}), store, COMMIT_B)
    a, b = commit_index_prefix("nightly", "cpu", COMMIT_A), commit_index_prefix("nightly", "cpu", COMMIT_B)
    assert a == "nightly/cpu/commits/a1b2c3d4e5f6/simple" and b == "nightly/cpu/commits/0123456789ab/simple"
    assert first.commit_indexes == [a] and second.commit_indexes == [b]
    assert second.commit_index_urls() == [f"{store.url}/{b}/"]
    assert _versions(store, a) == ["1.0.dev1"] and _versions(store, b) == ["1.0.dev2"]
    assert _versions(store, "nightly/cpu/simple") == ["1.0.dev1", "1.0.dev2"]
    root = store.get(f"{b}/index.json")
    assert root is not None and parse_json(root)["projects"] == [{"name": "demo"}]


def test_the_commit_index_links_the_channels_objects_and_stores_no_second_copy(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    _publish(make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")]}), store, COMMIT_A)
    _publish(make_run(tmp_path / "b", {"cpu": [("demo", "1.0.dev2")]}), store, COMMIT_B)
    keys = store.list("")
    wheels = [k for k in keys if k.endswith((".whl", ".metadata"))]
    assert all("/commits/" not in k for k in wheels), wheels  # a commit's index holds pages only
    assert max(Counter(posixpath.basename(k) for k in wheels).values()) == 1  # each object once on the target
    commit_index = commit_index_prefix("nightly", "cpu", COMMIT_B)
    (link,) = _json_links(store, f"{commit_index}/demo/index.json")
    assert link[0] == "nightly/cpu/simple/demo/demo-1.0.dev2-py3-none-any.whl"
    data = store.get(link[0])
    assert data is not None and sha256_bytes(data) == link[1]
    meta, (anchor,) = parse_html(store.get(f"{commit_index}/demo/index.html") or b"")
    assert anchor.href.startswith("../../../../simple/demo/demo-1.0.dev2-py3-none-any.whl#sha256=")
    assert meta["pypi:repository-version"] == "1.4"


def test_every_page_of_the_target_passes_the_independent_index_checker(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    run = make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")], "cu130": [("demo", "1.0.dev1+cu130")]})
    pinned = make_run(tmp_path / "pins", {"cpu": [("helper", "2.0")]}).artifacts_of("wheel")[0]
    plan = _publish(run, store, variants=("cpu", "cu130"), extra=[(None, tmp_path / "pins" / pinned.path)])
    assert plan.commit_indexes == [commit_index_prefix("nightly", v, COMMIT_A) for v in ("cpu", "cu130")]
    for index in plan.commit_indexes:  # what went beside the wheel (a pin, kiln-runtime) is in the commit's index
        assert sorted(p["name"] for p in parse_json(store.get(f"{index}/index.json") or b"")["projects"]) == [
            "demo", "helper"]
    report = check_local_index(tmp_path / "index")
    assert not report.problems, report.problems
    assert report.pages == 3 * 2 * 2  # (root, demo, helper) x (channel, commit) x two variants
    assert len(report.files) == 8  # 2 wheels per index page set, each linked by its channel and its commit page


def test_commit_pages_are_written_after_every_wheel_and_channel_page(tmp_path: Path) -> None:
    writes: list[str] = []

    class Recorded(HookedLocalStore):  # a real store that notes the order of its writes
        def before_write(self, key: str) -> None:
            writes.append(key)

    run = make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")], "cu130": [("demo", "1.0.dev1+cu130")]})
    _publish(run, Recorded(tmp_path / "index"), variants=("cpu", "cu130"))
    first_commit_page = min(i for i, k in enumerate(writes) if "/commits/" in k)
    assert all("/commits/" in k for k in writes[first_commit_page:]), writes
    assert {k for k in writes[:first_commit_page] if k.endswith("index.json")} == {
        f"nightly/{v}/simple/{p}" for v in ("cpu", "cu130") for p in ("index.json", "demo/index.json")}
    for index in ("nightly/cpu/commits/a1b2c3d4e5f6/simple", "nightly/cu130/commits/a1b2c3d4e5f6/simple"):
        mine = [k for k in writes if k.startswith(index + "/")]
        assert mine[-2:] == [f"{index}/index.json", f"{index}/index.html"]  # its root last


def test_a_variant_whose_upload_failed_gets_no_commit_index_and_the_plan_says_why(tmp_path: Path) -> None:
    def lose_cu130(store: Store, uploads) -> list[UploadResult]:  # fault injection: the cu130 upload fails
        return upload_each(store, [u for u in uploads if u.variant != "cu130"])

    run = make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")], "cu130": [("demo", "1.0.dev1+cu130")]})
    store = LocalStore(tmp_path / "index")
    plan = _publish(run, store, variants=("cpu", "cu130"), upload=lose_cu130)
    assert plan.commit_indexes == ["nightly/cpu/commits/a1b2c3d4e5f6/simple"]
    assert "demo-1.0.dev1+cu130-py3-none-any.whl" in plan.commit_held["cu130"]
    assert not [k for k in store.list("nightly/cu130/") if "/commits/" in k]
    assert "per-commit index of `cu130` not written" in plan.to_markdown()
    rerun = _publish(run, store, variants=("cpu", "cu130"))  # the next try completes it
    assert rerun.commit_indexes == [commit_index_prefix("nightly", v, COMMIT_A) for v in ("cpu", "cu130")]
    assert not check_local_index(tmp_path / "index").problems


def test_a_crash_before_the_commit_pages_leaves_every_link_good_and_a_rerun_finishes_them(tmp_path: Path) -> None:
    class FailsOnCommitPages(LocalStore):  # fault injection: the store goes away once the commit pages start
        def put_page(self, key, data, content_type, cache_control, expected_etag):  # type: ignore[no-untyped-def]
            if "/commits/" in key:
                raise TransientStoreError(f"{key}: injected outage")
            return super().put_page(key, data, content_type, cache_control, expected_etag)

    run = make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")]})
    with pytest.raises(TransientStoreError):
        _publish(run, FailsOnCommitPages(tmp_path / "index"))
    store = LocalStore(tmp_path / "index")
    assert _versions(store, "nightly/cpu/simple") == ["1.0.dev1"]
    assert not store.list("nightly/cpu/commits/")
    assert not check_local_index(tmp_path / "index").problems
    plan = _publish(run, store)
    assert plan.keys("present") and plan.commit_indexes == ["nightly/cpu/commits/a1b2c3d4e5f6/simple"]
    assert not check_local_index(tmp_path / "index").problems


def test_a_rerun_of_the_same_commit_changes_no_page(tmp_path: Path) -> None:
    run = make_run(tmp_path / "a", {"cpu": [("demo", "1.0.dev1")]})
    store = LocalStore(tmp_path / "index")
    _publish(run, store)
    again = publish(run, store,
                    PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"], commit=COMMIT_A),
                    PublishSteps(clock=lambda: 2e9))
    assert again.pages == [] and again.commit_indexes == ["nightly/cpu/commits/a1b2c3d4e5f6/simple"]


def test_a_release_writes_no_commit_index(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    plan = publish(make_run(tmp_path / "a", {"cpu": [("demo", "1.0")]}), store,
                   PublishRequest(channel="release", channel_prefix="release", variants=["cpu"]),
                   PublishSteps(clock=CLOCK))
    assert plan.commit_indexes == [] and all("/commits/" not in k for k in store.list(""))


@pytest.mark.parametrize("commit", ["a1b2c3d4e5f6", "A" * 40, "g" * 40, "a" * 41, "../" + "a" * 37])
def test_a_commit_that_is_not_a_full_hex_sha_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                    commit: str) -> None:
    store = LocalStore(tmp_path / "index")
    with pytest.raises(InvalidInputError, match=f"commit {commit!r} is not a full lowercase hex commit sha"):
        _publish(make_run(tmp_path / "a", {"cpu": [("demo", "1.0")]}), store, commit)
    assert store.list("") == []
