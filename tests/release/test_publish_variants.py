"""The combined index of a channel's PEP 825 variant wheels: its files, its variants file, crashes and races."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from kiln.core.dists import make_distribution
from kiln.core.errors import TransientStoreError
from kiln.core.fsutil import sha256_bytes
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore, Store
from kiln.flows.report.hint import install_command, install_reason
from kiln.release.index.render import group, parse_project_json, project_pages, variants_file_path
from kiln.release.index.variants import dumps
from kiln.release.publish.plan import COMBINED
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.read.verify import verify_index
from kiln.tasks.install_hint import install_facts
from tests.helpers.faults import HookedLocalStore
from tests.helpers.indexcheck import check_local_index
from tests.helpers.pageparse import parse_html, parse_json
from tests.helpers.runkit import CU130, make_variant_run, run_at_once

CLOCK = lambda: 1_700_000_000.0  # noqa: E731 - an injected, fixed clock
COMMIT = "a1b2c3d4e5f6" + "0" * 28
INDEX = f"nightly/{COMBINED}/simple"
VERSION = "1.0.dev1"
CU126 = {"nvidia": {"cuda_version_lower_bound": ["12.6"], "sm_arch": ["80_real"]}}


def _publish(run, store: Store, variants=("cu130", "cpu"), commit: str = ""):
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=list(variants),
                                              commit=commit),
                   PublishSteps(clock=CLOCK))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_links_resolve(store: Store, index: str, settled: bool = True) -> dict[str, list[str]]:
    """Every link of every project page (HTML and JSON each) resolves to bytes with its hash (and sidecar).

    Returns the files each project's JSON page lists. ``settled``: the two forms list the same files.
    """
    root = store.get(f"{index}/index.json")
    listed: dict[str, list[str]] = {}
    for project in [p["name"] for p in parse_json(root)["projects"]] if root else []:
        base = f"{index}/{project}/"
        html, data = store.get(base + "index.html"), store.get(base + "index.json")
        assert html is not None and data is not None, f"{project} is listed on the root but has no page"
        links = [(unquote(a.href.split("#")[0]), a.fragment.removeprefix("sha256="),
                  a.attrs.get("data-core-metadata")) for a in parse_html(html)[1]]
        entries = parse_json(data)["files"]
        links += [(unquote(e["url"]), e["hashes"]["sha256"], e.get("core-metadata")) for e in entries]
        for url, sha, metadata in links:
            key = posixpath.normpath(base + url)
            body = store.get(key)
            assert body is not None and sha256_bytes(body) == sha, f"{key} is listed with sha256 {sha}: missing or other"
            if metadata:
                sidecar = store.get(key + ".metadata")
                expected = metadata["sha256"] if isinstance(metadata, dict) else metadata.removeprefix("sha256=")
                assert sidecar is not None and sha256_bytes(sidecar) == expected, f"{key}.metadata"
        if settled:
            assert [unquote(a.decoded_name) for a in parse_html(html)[1]] == [e["filename"] for e in entries]
        listed[project] = [e["filename"] for e in entries]
    return listed


def _variants(store: Store, index: str = INDEX, project: str = "k", version: str = VERSION) -> dict[str, Any]:
    """The variants file of ``version`` that ``project``'s page links, read through the link."""
    base = f"{index}/{project}/"
    (entry,) = [e for e in parse_json(store.get(base + "index.json"))["files"]
                if e["filename"] == f"k-{version}-variants.json"]
    body = store.get(posixpath.normpath(base + entry["url"]))
    assert body is not None and sha256_bytes(body) == entry["hashes"]["sha256"]
    return dict(json.loads(body))


def test_the_combined_index_lists_the_variant_wheels_the_default_wheel_and_the_variants_file(tmp_path: Path) -> None:
    run = make_variant_run(tmp_path / "run", "k", VERSION, {"cu130": CU130, "cpu": {}})
    store = LocalStore(tmp_path / "target")
    plan = _publish(run, store, commit=COMMIT)
    assert assert_links_resolve(store, INDEX) == {"k": [
        "k-1.0.dev1-py3-none-any-null.whl", "k-1.0.dev1-py3-none-any.whl",
        "k-1.0.dev1-py3-none-linux_x86_64-cu130.whl", "k-1.0.dev1-variants.json"]}
    document = _variants(store)
    assert document["variants"] == {"cu130": CU130, "null": {}}
    assert document["providers"]["nvidia"]["plugin-api"] == "nvidia_variant_provider.plugin:NvidiaVariantPlugin"
    # the per-variant indexes still hold only their +local wheels
    assert assert_links_resolve(store, "nightly/cu130/simple") == {"k": ["k-1.0.dev1+cu130-py3-none-any.whl"]}
    assert assert_links_resolve(store, "nightly/cpu/simple") == {"k": ["k-1.0.dev1+cpu-py3-none-any.whl"]}
    # its per-commit index links the channel's objects, the variants file's copy too
    commit_index = f"nightly/{COMBINED}/commits/a1b2c3d4e5f6/simple"
    assert commit_index in plan.commit_indexes
    assert assert_links_resolve(store, commit_index) == assert_links_resolve(store, INDEX)
    assert _variants(store, commit_index) == document
    assert not [k for k in store.list(commit_index) if not k.endswith(("/index.html", "/index.json"))]
    assert not check_local_index(tmp_path / "target").problems


def test_a_rerun_publishes_nothing_new_and_changes_no_byte(tmp_path: Path) -> None:
    run = make_variant_run(tmp_path / "run", "k", VERSION, {"cu130": CU130, "cpu": {}})
    store = LocalStore(tmp_path / "target")
    _publish(run, store, commit=COMMIT)
    before = _snapshot(tmp_path / "target")
    again = publish(run, store,
                    PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"], commit=COMMIT),
                    PublishSteps(clock=lambda: 2e9))
    assert again.keys("added") == [] and again.pages == [] and again.variants_refused == {}
    assert _snapshot(tmp_path / "target") == before


def test_another_version_gets_its_own_variants_file_and_a_later_label_is_added_to_the_first(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "target")
    _publish(make_variant_run(tmp_path / "a", "k", VERSION, {"cu130": CU130, "cpu": {}}), store)
    first = _variants(store)
    _publish(make_variant_run(tmp_path / "b", "k", "1.0.dev2", {"cu130": CU130, "cpu": {}}), store)
    assert _variants(store) == first and list(_variants(store, version="1.0.dev2")["variants"]) == ["cu130", "null"]
    # a later run of the same version adds a label (a variant built since): the first's are kept
    plan = _publish(make_variant_run(tmp_path / "c", "k", VERSION, {"cu126": CU126}), store, variants=["cu126"])
    assert plan.variants_refused == {}
    assert _variants(store)["variants"] == {"cu126": CU126, "cu130": CU130, "null": {}}
    listed = assert_links_resolve(store, INDEX)["k"]
    assert listed.count("k-1.0.dev1-variants.json") == 1 and "k-1.0.dev2-variants.json" in listed
    copies = [k for k in store.list(f"{INDEX}/k/variants/") if k.endswith("k-1.0.dev1-variants.json")]
    assert len(copies) == 2  # the first content stays where it was: published bytes never change


def test_a_conflicting_label_is_refused_by_name_and_nothing_of_the_project_reaches_the_combined_index(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "target")
    _publish(make_variant_run(tmp_path / "a", "k", VERSION, {"cu130": CU130, "cpu": {}}), store)
    before = {k: v for k, v in _snapshot(tmp_path / "target").items() if k.startswith(f"nightly/{COMBINED}/")}
    changed = {"nvidia": {"cuda_version_lower_bound": ["12.8"], "sm_arch": ["90_real"]}}
    plan = _publish(make_variant_run(tmp_path / "b", "k", VERSION, {"cu130": changed}), store, variants=["cu130"],
                    commit=COMMIT)
    assert "variant label 'cu130' is already defined" in plan.variants_refused["k"]
    assert "not published to the combined index `wheel-variants`" in plan.to_markdown()
    assert all(r.upload.variant != COMBINED for r in plan.results)  # nothing of it was even uploaded
    after = {k: v for k, v in _snapshot(tmp_path / "target").items() if k.startswith(f"nightly/{COMBINED}/")}
    assert after == before
    assert plan.keys("present") == ["nightly/cu130/simple/k/k-1.0.dev1+cu130-py3-none-any.whl"]
    assert plan.commit_indexes == ["nightly/cu130/commits/a1b2c3d4e5f6/simple"] and COMBINED in plan.commit_held


class _CheckedAfterEveryWrite(LocalStore):
    """A real store that checks every link of the combined index after each of its writes."""

    checks = 0

    def put_immutable(self, key, data, content_type, cache_control):  # type: ignore[no-untyped-def]
        info = super().put_immutable(key, data, content_type, cache_control)
        assert_links_resolve(self, INDEX, settled=False)
        type(self).checks += 1
        return info

    def put_immutable_file(self, key, path, sha256, content_type, cache_control):  # type: ignore[no-untyped-def]
        info = super().put_immutable_file(key, path, sha256, content_type, cache_control)
        assert_links_resolve(self, INDEX, settled=False)
        type(self).checks += 1
        return info

    def put_page(self, key, data, content_type, cache_control, expected_etag):  # type: ignore[no-untyped-def]
        info = super().put_page(key, data, content_type, cache_control, expected_etag)
        assert_links_resolve(self, INDEX, settled=False)
        type(self).checks += 1
        return info


def test_every_link_resolves_after_every_write_while_labels_are_added(tmp_path: Path) -> None:
    store = _CheckedAfterEveryWrite(tmp_path / "target")
    _publish(make_variant_run(tmp_path / "a", "k", VERSION, {"cu130": CU130, "cpu": {}}), store, commit=COMMIT)
    _publish(make_variant_run(tmp_path / "b", "k", VERSION, {"cu126": CU126}), store, variants=["cu126"],
             commit=COMMIT)
    assert _CheckedAfterEveryWrite.checks > 20
    assert list(_variants(store)["variants"]) == ["cu126", "cu130", "null"]


class _FailsAfter(HookedLocalStore):
    """Fault injection: the store goes away (a transient error) at write number ``limit``."""

    def __init__(self, root: Path, limit: int) -> None:
        super().__init__(root)
        self.limit, self.writes = limit, 0

    def before_write(self, key: str) -> None:
        self.writes += 1
        if self.writes > self.limit:
            raise TransientStoreError(f"{key}: injected outage")


def test_a_publish_stopped_at_any_write_leaves_every_link_good_and_a_rerun_completes_it(tmp_path: Path) -> None:
    base = make_variant_run(tmp_path / "base", "k", VERSION, {"cu130": CU130, "cpu": {}})
    run = make_variant_run(tmp_path / "new", "k", VERSION, {"cu126": CU126})
    probe = _FailsAfter(tmp_path / "probe", 10**9)
    _publish(base, probe, commit=COMMIT)
    start = probe.writes
    _publish(run, probe, variants=["cu126"], commit=COMMIT)
    total = probe.writes - start
    for point in range(total):
        target = tmp_path / f"t{point}"
        _publish(base, LocalStore(target), commit=COMMIT)
        with pytest.raises(TransientStoreError):
            _publish(run, _FailsAfter(target, point), variants=["cu126"], commit=COMMIT)
        store = LocalStore(target)
        assert "k-1.0.dev1-py3-none-any.whl" in assert_links_resolve(store, INDEX, settled=False)["k"]
        assert set(_variants(store)["variants"]) >= {"cu130", "null"}  # what was published stays
        assert not check_local_index(target).problems, point
        _publish(run, store, variants=["cu126"], commit=COMMIT)
        assert list(_variants(store)["variants"]) == ["cu126", "cu130", "null"], point
        assert_links_resolve(store, INDEX)
        assert _variants(store, f"nightly/{COMBINED}/commits/a1b2c3d4e5f6/simple")["variants"].keys() == {
            "cu126", "cu130", "null"}


def test_publishers_at_once_lose_no_label(tmp_path: Path) -> None:
    names = ["cu126", "cu128", "cu129", "cu130"]
    runs = [make_variant_run(tmp_path / name, "k", VERSION,
                             {name: {"nvidia": {"cuda_version_lower_bound": [f"{name[2:4]}.{name[4]}"]}}})
            for name in names]
    errors = run_at_once(lambda run: _publish(run, LocalStore(tmp_path / "target"), variants=names), runs)
    assert errors == []
    store = LocalStore(tmp_path / "target")
    assert list(_variants(store)["variants"]) == names
    assert len(assert_links_resolve(store, INDEX)["k"]) == len(names) + 1


def test_the_install_hint_of_the_combined_index_is_uvs_with_the_preview_and_pip_keeps_the_variants(
    tmp_path: Path,
) -> None:
    run = make_variant_run(tmp_path / "run", "k", VERSION, {"cu130": CU130, "cpu": {}})
    plan = _publish(run, LocalStore(tmp_path / "target"))
    install = install_facts("k", ["https://pypi.org/simple"], plan, check=False)
    combined, cpu = f"{plan.target}/{INDEX}/", f"{plan.target}/nightly/cpu/simple/"
    assert install["indexes"][combined]["version"] == VERSION and install["indexes"][combined]["variants"]
    assert install_command(combined, install) == (
        f"env -u UV_CONFIG_FILE -u UV_INDEX -u UV_EXTRA_INDEX_URL -u UV_FIND_LINKS -u UV_OVERRIDE uv pip install --no-config --preview-features wheel-variants --index-strategy first-index --index {combined} "
        f"--default-index https://pypi.org/simple k=={VERSION}")
    assert install_command(cpu, install).startswith(f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {cpu} ")
    assert "uv's preview installs the one this machine supports" in install_reason(combined, install)


def _rewrite_variants_file(store: Store, document: dict[str, Any]) -> None:
    """Tamper (test only): the page links another variants file, whose copy is stored under its own hash."""
    key = f"{INDEX}/k/index.json"
    data = dumps(document)
    name = f"k-{VERSION}-variants.json"
    store.put_immutable(f"{INDEX}/k/{variants_file_path(name, sha256_bytes(data))}", data, "application/json", "x")
    dists = [d for d in parse_project_json(store.get(key) or b"", key) if d.filename != name]
    dists.append(make_distribution(name, sha256_bytes(data), len(data), CLOCK()))
    for page, body in project_pages("k", group(dists)["k"]).items():
        current = store.get_page(f"{INDEX}/{page}")
        store.put_page(f"{INDEX}/{page}", body, "text/html", "x", current[1] if current else None)


def test_verify_checks_the_variants_file_against_every_variant_wheel(tmp_path: Path) -> None:
    run = make_variant_run(tmp_path / "run", "k", VERSION, {"cu130": CU130, "cpu": {}})
    store = LocalStore(tmp_path / "target")
    _publish(run, store)
    url = (tmp_path / "target" / INDEX).as_uri() + "/"
    report = verify_index(url, install=False)
    assert report.ok, report.summary()
    assert any("PEP 825 variant wheels" in note for note in report.notes)
    published = _variants(store)
    _rewrite_variants_file(store, {**published, "variants": {"null": {}}})  # cu130's label left out
    report = verify_index(url, install=False)
    assert any("lacks the variant labels ['cu130']" in p for p in report.problems), report.problems
    _rewrite_variants_file(store, {**published, "variants": {**published["variants"], "cu130": CU126}})
    report = verify_index(url, install=False)
    assert any("variant label 'cu130' is already defined" in p for p in report.problems), report.problems


def test_on_s3_publishers_at_once_lose_no_label(tmp_path: Path, s3_endpoint: str, s3_session: Any,
                                                s3_bucket: str) -> None:
    names = ["cu126", "cu128", "cu129", "cu130"]
    runs = [make_variant_run(tmp_path / name, "k", VERSION,
                             {name: {"nvidia": {"cuda_version_lower_bound": [f"{name[2:4]}.{name[4]}"]}}})
            for name in names]
    # a client per publisher, as separate jobs would have
    publishers = [(run, S3Store(make_client(s3_session, "us-east-1", s3_endpoint), s3_bucket, "site")) for run in runs]
    errors = run_at_once(lambda pair: _publish(pair[0], pair[1], variants=names, commit=COMMIT), publishers)
    assert errors == []
    store = S3Store(make_client(s3_session, "us-east-1", s3_endpoint), s3_bucket, "site")
    assert list(_variants(store)["variants"]) == names
    assert len(assert_links_resolve(store, INDEX)["k"]) == len(names) + 1
    commit_index = f"nightly/{COMBINED}/commits/a1b2c3d4e5f6/simple"
    assert list(_variants(store, commit_index)["variants"]) == names


class _RacedBy(HookedLocalStore):
    """Fault injection: just before this publisher's first combined-index upload lands, another publisher
    publishes the same version with the cu130 label defined otherwise (between this one's label check and
    its page write; every upload comes before any page, so the first write there is an upload)."""

    def __init__(self, root: Path, other: Any) -> None:
        super().__init__(root)
        self.other, self.raced = other, False

    def before_write(self, key: str) -> None:
        if not self.raced and key.startswith(f"nightly/{COMBINED}/"):
            self.raced = True
            _publish(self.other, LocalStore(self.root), variants=["cu130"])


def test_a_label_defined_otherwise_meanwhile_is_an_upload_conflict_and_every_link_stays_good(tmp_path: Path) -> None:
    """The label check runs before the uploads; a publisher that defines the same version's label otherwise in
    between wrote the same variant wheel name with other bytes, so this one's upload of it is a conflict (never
    a page that mixes the two definitions), and every other file and index is published."""
    other = make_variant_run(tmp_path / "other", "k", VERSION,
                             {"cu130": {"nvidia": {"cuda_version_lower_bound": ["12.8"], "sm_arch": ["90_real"]}}})
    store = _RacedBy(tmp_path / "target", other)
    plan = _publish(make_variant_run(tmp_path / "a", "k", VERSION, {"cu130": CU130, "cpu": {}}), store)
    assert store.raced
    assert plan.keys("conflict") == [f"nightly/{COMBINED}/simple/k/k-1.0.dev1-py3-none-linux_x86_64-cu130.whl"]
    cpu = parse_json(store.get("nightly/cpu/simple/k/index.json"))["files"]
    assert [f["filename"] for f in cpu] == ["k-1.0.dev1+cpu-py3-none-any.whl"]  # its own index was still written
    assert_links_resolve(store, INDEX)  # the combined index keeps the other publisher's definition, whole
    assert _variants(store)["variants"]["cu130"] == {"nvidia": {"cuda_version_lower_bound": ["12.8"],
                                                                "sm_arch": ["90_real"]}}
