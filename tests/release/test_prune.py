"""Retention (``kiln prune``): yank older nightlies, remove them after the grace period, never break a link.

The observer here shares nothing with Kiln's code: it reads raw bytes (the
filesystem, or boto3 against moto's S3 server), parses every HTML and JSON
page with the standard library and checks every link's hash.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urldefrag

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.release.publish.plan import commit_index_prefix
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.publish.prune import LEDGER, Retention, prune
from tests.helpers.pageparse import parse_html, parse_json
from tests.helpers.runkit import CU130, make_run, make_variant_run, run_at_once
from tests.helpers.s3 import S3_ENV

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120
COMMITS = ["a" * 40, "b" * 40, "c" * 40]
DAY = 86400
T0 = 1_700_000_000.0
CPU = "nightly/cpu/simple"

Read = Callable[[str], bytes | None]


def _publish(tmp: Path, store: Any, n: int, variants: tuple[str, ...] = ("cpu",)) -> None:
    """The n-th nightly (1-based): demo 1.0.dev<n> of commit n, with the pinned helper 2.0 beside it."""
    wheels = {v: [("demo", f"1.0.dev{n}" + ("" if v == "cpu" else f"+{v}"))] for v in variants}
    run = make_run(tmp / f"run{n}", wheels)
    pins = make_run(tmp / f"pins{n}", {"cpu": [("helper", "2.0")]})
    publish(run, store,
            PublishRequest(channel="nightly", channel_prefix="nightly", variants=list(variants),
                           extra=[(None, pins.root / pins.artifacts[0].path)], commit=COMMITS[n - 1]),
            PublishSteps(clock=lambda: T0 + n))


def _prune(store: Any, keep: int = 1, grace_days: float = 0, now: float = T0 + 10, **kw: Any):
    return prune(store, channel="nightly", channel_prefix="nightly", retention=Retention(keep, grace_days),
                 clock=lambda: now, **kw)


def _local_read(root: Path) -> Read:
    def read(key: str) -> bytes | None:
        path = root / key
        return path.read_bytes() if path.is_file() else None
    return read


def _s3_read(client: Any, bucket: str, prefix: str = "site/") -> Read:
    def read(key: str) -> bytes | None:
        try:
            return client.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
    return read


def broken_links(read: Read, keys: list[str]) -> list[str]:
    """Every link of every page (HTML anchors, JSON files) that does not resolve to bytes with its hash."""
    problems = []
    for page in (k for k in keys if k.endswith(("/index.html", "/index.json"))):
        data = read(page)
        if data is None:
            continue  # deleted since it was listed
        base = posixpath.dirname(page)
        if page.endswith(".html"):
            links = [(unquote(a.url), a.fragment.removeprefix("sha256="), a.attrs.get("data-core-metadata"))
                     for a in parse_html(data)[1]]
        else:
            links = [(unquote(urldefrag(f["url"])[0]), f["hashes"]["sha256"],
                      "sha256=" + f["core-metadata"]["sha256"] if isinstance(f.get("core-metadata"), dict) else None)
                     for f in parse_json(data).get("files", [])]
        for url, digest, metadata in links:
            target = posixpath.normpath(f"{base}/{url}")
            if url.endswith("/"):  # the root page's link to a project page
                if read(f"{target}/index.html") is None:
                    problems.append(f"{page}: {url} has no page")
                continue
            body = read(target)
            if body is None or hashlib.sha256(body).hexdigest() != digest:
                problems.append(f"{page}: {target} {'missing' if body is None else 'has other bytes'}")
            sidecar = read(target + ".metadata") if metadata else b""
            if metadata and (sidecar is None or "sha256=" + hashlib.sha256(sidecar).hexdigest() != metadata):
                problems.append(f"{page}: {target}.metadata missing or other bytes")
    return problems


def _files(store: Any, index: str = CPU, project: str = "demo") -> dict[str, Any]:
    data = store.get(f"{index}/{project}/index.json")
    return {} if data is None else {f["filename"]: f.get("yanked", False) for f in parse_json(data)["files"]}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def two(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "index")
    _publish(tmp_path, store, 1)
    _publish(tmp_path, store, 2)
    return store


def test_a_dry_run_changes_nothing_and_prints_the_plan(two: LocalStore) -> None:
    before = _snapshot(two.root)
    plan = _prune(two, dry_run=True)
    assert _snapshot(two.root) == before
    assert plan.yanked == [f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"]
    assert plan.removed == plan.yanked and plan.commit_indexes == [commit_index_prefix("nightly", "cpu", COMMITS[0])]
    assert f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl.metadata" in plan.deleted
    markdown = plan.to_markdown()
    assert "dry run" in markdown and "delete per-commit indexes (would): 1" in markdown, markdown


def test_keep_one_without_grace_removes_the_older_commit_everywhere(two: LocalStore) -> None:
    plan = _prune(two)
    old = f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"
    assert plan.removed == [old] and sorted(plan.deleted) == [old, old + ".metadata"]
    assert _files(two) == {"demo-1.0.dev2-py3-none-any.whl": False}
    assert two.get(old) is None and two.get(old + ".metadata") is None
    first, second = (commit_index_prefix("nightly", "cpu", c) for c in COMMITS[:2])
    assert two.list(f"{first}/") == [] and two.get(f"{second}/demo/index.json") is not None
    assert list(_files(two, project="helper")) == ["helper-2.0-py3-none-any.whl"]  # a project's last version stays
    assert json.loads(two.get(f"nightly/cpu/{LEDGER}") or b"{}") == {"files": {}}
    assert broken_links(_local_read(two.root), two.list("")) == []
    assert not _prune(two).changed  # a second prune has nothing left to do


def test_a_grace_period_only_yanks_then_a_later_prune_removes(two: LocalStore) -> None:
    first = _prune(two, grace_days=7)
    assert first.yanked and not first.removed and not first.deleted
    yanked = _files(two)["demo-1.0.dev1-py3-none-any.whl"]
    assert "older than the newest 1 nightlies" in yanked and "2023-11-21T22:13:30Z" in yanked, yanked
    html = (two.root / CPU / "demo" / "index.html").read_text()
    assert "data-yanked=" in html
    early = _prune(two, grace_days=7, now=T0 + 10 + 6 * DAY)
    assert not early.changed and list(early.waiting) == [f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"]
    late = _prune(two, grace_days=7, now=T0 + 10 + 7 * DAY)
    assert late.removed == [f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"] and len(late.deleted) == 2
    assert list(_files(two)) == ["demo-1.0.dev2-py3-none-any.whl"]
    assert broken_links(_local_read(two.root), two.list("")) == []


def test_raising_keep_unyanks_what_it_now_covers(two: LocalStore) -> None:
    _prune(two, grace_days=7)
    plan = _prune(two, keep=2, grace_days=7, now=T0 + 30 * DAY)
    assert plan.unyanked == [f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"] and not plan.deleted
    assert _files(two) == {"demo-1.0.dev1-py3-none-any.whl": False, "demo-1.0.dev2-py3-none-any.whl": False}


def test_an_object_another_page_still_links_is_not_deleted(two: LocalStore, tmp_path: Path) -> None:
    # Another index root in the channel whose page lists the old wheel (as a hand-made alias would).
    page = two.get(f"{commit_index_prefix('nightly', 'cpu', COMMITS[0])}/demo/index.json") or b""
    alias = "nightly/cpu/aliases/first/simple"
    two.put_page(f"{alias}/demo/index.json", page, "application/json", "no-cache", None)  # same depth
    old = f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"
    ahead = _prune(two, dry_run=True)
    assert old in ahead.held and old not in ahead.deleted  # the dry run sees the alias too
    plan = _prune(two)
    assert old in plan.held and f"{alias}/demo/index.json" in plan.held[old]
    assert two.get(old) is not None and broken_links(_local_read(two.root), two.list("")) == []


def test_a_crafted_ledger_deletes_no_page_and_no_other_file(two: LocalStore) -> None:
    """retention.json is a page the publisher can write: entries naming the project's own pages, a path out of
    the project, another project's file or a file whose bytes changed are ignored (or held) and reported."""
    pages = [f"{CPU}/demo/index.json", f"{CPU}/demo/index.html", f"{CPU}/index.json"]
    helper = f"{CPU}/helper/helper-2.0-py3-none-any.whl"
    old = f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl"
    forged = {"demo/index.json": "0" * 64, "demo/index.html": "0" * 64, "demo/../index.json": "0" * 64,
              "demo/helper-2.0-py3-none-any.whl": "0" * 64, "helper/helper-2.0-py3-none-any.whl": "not-a-hash",
              "demo/demo-1.0.dev1-py3-none-any.whl": "f" * 64}  # a real candidate, but not the bytes stored
    ledger = {"files": {k: {"yanked_at": 0, "sha256": v} for k, v in forged.items()}}
    two.put_page(f"nightly/cpu/{LEDGER}", json.dumps(ledger).encode(), "application/json", "no-cache", None)
    helper_bytes = two.get(helper)
    plan = _prune(two, keep=1)
    assert helper_bytes is not None and two.get(helper) == helper_bytes and two.get(pages[2]) is not None
    assert two.get(pages[0]) is not None and two.get(pages[1]) is not None  # rewritten by the prune, never deleted
    ignored = {k.removeprefix(f"{CPU}/"): why for k, why in plan.ignored.items()}
    assert set(ignored) == set(forged), plan.ignored
    assert "sha256" in ignored["demo/demo-1.0.dev1-py3-none-any.whl"]
    assert sorted(plan.deleted) == [old, old + ".metadata"]  # the real candidate, recorded anew with its own hash
    assert "ignored ledger entry" in plan.to_markdown()
    assert broken_links(_local_read(two.root), two.list("")) == []


def test_a_per_commit_index_loses_only_its_pages(two: LocalStore) -> None:
    first = commit_index_prefix("nightly", "cpu", COMMITS[0])
    stray = f"{first}/demo/notes.txt"  # not a page Kiln wrote there
    two.put_immutable(stray, b"kept", "text/plain", "no-cache")
    plan = _prune(two)
    assert plan.commit_indexes == [first]
    assert two.get(f"{first}/demo/index.json") is None and two.get(stray) == b"kept"


def test_bad_retention_and_the_release_channel_are_refused(two: LocalStore) -> None:
    with pytest.raises(InvalidInputError, match="at least 1"):
        Retention(0, 0)
    with pytest.raises(InvalidInputError, match="releases are never pruned"):
        prune(two, channel="release", channel_prefix="release", retention=Retention(1, 0))
    with pytest.raises(InvalidInputError, match="releases are never pruned"):
        prune(two, channel="nightly", channel_prefix="release/nightly", retention=Retention(1, 0))


def test_the_combined_and_every_variant_index_are_pruned_alike(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    for n in (1, 2, 3):
        _publish(tmp_path, store, n, variants=("cpu", "cu130"))
    plan = _prune(store, keep=2)
    assert sorted(plan.removed) == [f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl",
                                    "nightly/cu130/simple/demo/demo-1.0.dev1+cu130-py3-none-any.whl"]
    assert len(plan.commit_indexes) == 2
    assert broken_links(_local_read(store.root), store.list("")) == []


def _child(args: list[str], kill_after: int | None = None) -> subprocess.CompletedProcess[str]:
    extra = [] if kill_after is None else ["--kill-after", str(kill_after)]
    return subprocess.run([sys.executable, "-m", "tests.release.prune_child", *args, "--now", str(T0 + 10), *extra],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=REPO,
                          env={**os.environ, **S3_ENV, "PYTHONPATH": str(REPO)})


def _kill_points(total: int, count: int) -> list[int]:
    rng = random.Random(total)  # drawn, reproducibly
    return sorted({0, total - 1, *rng.sample(range(1, max(total - 1, 2)), min(count, max(total - 2, 1)))})


def _expect_pruned(read: Read, keys: list[str]) -> None:
    assert broken_links(read, keys) == []
    page = json.loads(read(f"{CPU}/demo/index.json") or b"{}")
    assert [f["filename"] for f in page["files"]] == ["demo-1.0.dev2-py3-none-any.whl"]
    assert read(f"{CPU}/demo/demo-1.0.dev1-py3-none-any.whl") is None
    assert read(f"{commit_index_prefix('nightly', 'cpu', COMMITS[0])}/index.json") is None


@pytest.mark.slow
def test_sigkill_at_drawn_points_of_a_local_prune_breaks_no_link_and_a_rerun_completes(tmp_path: Path) -> None:
    def fresh(name: str) -> LocalStore:
        store = LocalStore(tmp_path / name)
        _publish(tmp_path / name, store, 1)
        _publish(tmp_path / name, store, 2)
        return store

    probe = _child(["--dir", str(fresh("probe").root)])
    assert probe.returncode == 0, probe.stderr[-2000:]
    total = json.loads(probe.stdout)["requests"]
    for point in _kill_points(total, 6):
        store = fresh(f"k{point}")
        killed = _child(["--dir", str(store.root)], kill_after=point)
        assert killed.returncode == -9, f"kill point {point}/{total}: {killed.returncode} {killed.stderr[-2000:]}"
        read = _local_read(store.root)
        assert broken_links(read, store.list("")) == [], f"after a kill at {point}/{total}"
        rerun = _child(["--dir", str(store.root)])
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        _expect_pruned(read, store.list(""))


@pytest.mark.slow
def test_sigkill_at_drawn_points_of_an_s3_prune_breaks_no_link_and_a_rerun_completes(
        tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str) -> None:
    client = make_client(s3_session, "us-east-1", s3_endpoint)

    def fresh(bucket: str) -> S3Store:
        client.create_bucket(Bucket=bucket)
        store = S3Store(client, bucket, "site")
        _publish(tmp_path / bucket, store, 1)
        _publish(tmp_path / bucket, store, 2)
        return store

    probe = _child(["--endpoint", s3_endpoint, "--bucket", fresh(f"{s3_bucket}-probe").bucket])
    assert probe.returncode == 0, probe.stderr[-2000:]
    total = json.loads(probe.stdout)["requests"]
    for n, point in enumerate(_kill_points(total, 5)):
        store = fresh(f"{s3_bucket}-k{n}")
        killed = _child(["--endpoint", s3_endpoint, "--bucket", store.bucket], kill_after=point)
        assert killed.returncode == -9, f"kill point {point}/{total}: {killed.returncode} {killed.stderr[-2000:]}"
        read = _s3_read(client, store.bucket)
        assert broken_links(read, store.list("")) == [], f"after a kill at {point}/{total}"
        rerun = _child(["--endpoint", s3_endpoint, "--bucket", store.bucket])
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        _expect_pruned(read, store.list(""))


def test_a_prune_racing_a_publish_loses_no_new_entry(tmp_path: Path) -> None:
    for attempt in range(4):
        store = LocalStore(tmp_path / f"race{attempt}")
        _publish(tmp_path / f"r{attempt}", store, 1)
        _publish(tmp_path / f"r{attempt}", store, 2)
        jobs = [functools.partial(_publish, tmp_path / f"p{attempt}", store, 3), functools.partial(_prune, store)]
        errors = run_at_once(lambda job: job(), jobs)
        assert errors == []
        listed = _files(store)
        assert "demo-1.0.dev3-py3-none-any.whl" in listed and "demo-1.0.dev1-py3-none-any.whl" not in listed
        assert store.get(f"{commit_index_prefix('nightly', 'cpu', COMMITS[2])}/demo/index.json") is not None
        assert broken_links(_local_read(store.root), store.list("")) == []


def test_the_combined_index_loses_an_old_version_with_every_copy_of_its_variants_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    publish(make_variant_run(tmp_path / "a", "k", "1.0.dev1", {"cpu": {}}), store,
            PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]),
            PublishSteps(clock=lambda: T0))
    publish(make_variant_run(tmp_path / "b", "k", "1.0.dev1", {"cu130": CU130, "cpu": {}}), store,  # a label more
            PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"]),
            PublishSteps(clock=lambda: T0))
    publish(make_variant_run(tmp_path / "c", "k", "1.0.dev2", {"cu130": CU130, "cpu": {}}), store,
            PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"]),
            PublishSteps(clock=lambda: T0))
    copies = [k for k in store.list("nightly/wheel-variants/simple/k/variants/") if "1.0.dev1" in k]
    assert len(copies) == 2  # one immutable copy per content the file had
    plan = _prune(store)
    assert set(copies) <= set(plan.deleted) and not plan.held
    assert [k for k in store.list("nightly/") if "1.0.dev1" in k] == []
    assert broken_links(_local_read(store.root), store.list("")) == []
