"""The publish protocol against a local directory target."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kiln.core.dists import make_distribution
from kiln.core.errors import ConflictError, IntegrityError, InvalidInputError
from kiln.core.fsutil import sha256_bytes
from kiln.core.manifest import RunManifest, Unit
from kiln.core.store import LocalStore
from kiln.core.swap import CAS_ATTEMPTS
from kiln.release.publish.pages import update_pages
from kiln.release.publish.plan import gate
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.stores.staging import StagingStore
from tests.helpers.faults import CorruptingStore
from tests.helpers.pageparse import parse_html, parse_json
from tests.helpers.runkit import make_run, run_at_once
from tests.helpers.wheelkit import make_wheel

CLOCK = lambda: 1_700_000_000.0  # noqa: E731 - an injected, fixed clock


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _check_file(store, base: str, filename: str, sha256: str, size: int | None, metadata_sha256: str | None) -> None:
    data = store.get(f"{base}/{filename}")
    assert data is not None, f"{base}/{filename} is listed but missing"
    assert sha256_bytes(data) == sha256 and (size is None or len(data) == size), f"{filename}: hash or size differs"
    sidecar = store.get(f"{base}/{filename}.metadata")
    assert sidecar is not None and sha256_bytes(sidecar) == metadata_sha256, f"{filename}: sidecar missing or differs"


def assert_index_consistent(store, index: str, settled: bool = True) -> int:
    """Every link of every page (HTML and JSON, each on its own) resolves to bytes with the advertised hash.

    ``settled``: also require the HTML and JSON pages to list the same things
    (not true mid-publish or after a crash: the pair is two writes). Returns
    the number of files the JSON pages list.
    """
    root_html, root_json = store.get(f"{index}/index.html"), store.get(f"{index}/index.json")
    html_projects = [a.href.rstrip("/") for a in parse_html(root_html)[1]] if root_html else []
    json_projects = [p["name"] for p in parse_json(root_json)["projects"]] if root_json else []
    if settled:
        assert sorted(html_projects) == sorted(json_projects)
    files = 0
    for project in sorted(set(html_projects) | set(json_projects)):
        base = f"{index}/{project}"
        html, data = store.get(f"{base}/index.html"), store.get(f"{base}/index.json")
        assert html is not None and data is not None, f"{project} is listed on the root but has no page"
        anchors = parse_html(html)[1]
        for anchor in anchors:
            metadata = anchor.attrs["data-core-metadata"].removeprefix("sha256=")
            assert anchor.attrs["data-dist-info-metadata"] == anchor.attrs["data-core-metadata"]
            _check_file(store, base, anchor.decoded_name, anchor.fragment.removeprefix("sha256="), None, metadata)
        entries = parse_json(data)["files"]
        for entry in entries:
            _check_file(store, base, entry["filename"], entry["hashes"]["sha256"], entry["size"],
                        entry["core-metadata"]["sha256"])
        if settled:
            assert [a.decoded_name for a in anchors] == [e["filename"] for e in entries]
        files += len(entries) if project in json_projects else 0
    return files


def page_keys(store) -> list[str]:
    return [k for k in store.list() if k.endswith(("/index.html", "/index.json"))]


def plant_sidecar_with_other_bytes(run: RunManifest, store, index: str, wheel_present: bool) -> str:
    """The run's one wheel's sidecar key, holding METADATA of another version; the wheel itself too if asked."""
    wheel = run.root / run.artifacts[0].path
    key = f"{index}/k/{wheel.name}"
    if wheel_present:  # as a crashed earlier publish of these very bytes would leave it
        store.put_immutable(key, wheel.read_bytes(), "application/octet-stream", "no-cache")
    store.put_immutable(key + ".metadata", b"Metadata-Version: 2.1\nName: k\nVersion: 0.9\n", "text/plain", "no-cache")
    return key + ".metadata"


def _publish(run: RunManifest, store, dry_run: bool = False):
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"],
                                              dry_run=dry_run),
                   PublishSteps(clock=CLOCK))


def test_publish_writes_per_variant_indexes_that_resolve(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run",
                   {"cu130": [("kiln-kernels", "0.1.0+cu130")], "cpu": [("kiln-kernels", "0.1.0+cpu")]})
    store = LocalStore(tmp_path / "target")
    plan = _publish(run, store)
    assert plan.keys("added") == [
        "nightly/cpu/simple/kiln-kernels/kiln_kernels-0.1.0+cpu-py3-none-any.whl",
        "nightly/cu130/simple/kiln-kernels/kiln_kernels-0.1.0+cu130-py3-none-any.whl",
    ]
    assert assert_index_consistent(store, "nightly/cu130/simple") == 1
    assert assert_index_consistent(store, "nightly/cpu/simple") == 1
    assert set(plan.pages) == {f"nightly/{v}/simple/{p}" for v in ("cu130", "cpu")
                               for p in ("index.html", "index.json", "kiln-kernels/index.html",
                                         "kiln-kernels/index.json")}


def test_rerun_uploads_nothing_and_changes_no_bytes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("kiln-kernels", "0.1.0+cu130")]})
    store = LocalStore(tmp_path / "target")
    _publish(run, store)
    before = _snapshot(tmp_path / "target")
    plan = publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
                   PublishSteps(clock=lambda: 2e9))
    assert plan.keys("added") == [] and len(plan.keys("present")) == 1 and plan.pages == []
    assert _snapshot(tmp_path / "target") == before


def test_second_run_merges_into_existing_pages(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "target")
    _publish(make_run(tmp_path / "a", {"cu130": [("kiln-kernels", "0.1.0+cu130")]}), store)
    plan = _publish(make_run(tmp_path / "b", {"cu130": [("kiln-kernels", "0.2.0+cu130")]}), store)
    assert set(plan.pages) == {"nightly/cu130/simple/kiln-kernels/index.html",
                               "nightly/cu130/simple/kiln-kernels/index.json"}
    page = parse_json(store.get("nightly/cu130/simple/kiln-kernels/index.json"))
    assert page["versions"] == ["0.1.0+cu130", "0.2.0+cu130"]
    assert assert_index_consistent(store, "nightly/cu130/simple") == 2


def test_variant_with_failed_build_or_required_test_is_not_published(tmp_path: Path) -> None:
    units = [Unit("build/cu130/x", "build", "failed", variant="cu130"),
             Unit("build/cpu/x", "build", "completed", variant="cpu"),
             Unit("test/optional", "test", "failed", required=False)]
    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0+cu130")], "cpu": [("k", "1.0+cpu")]}, units)
    store = LocalStore(tmp_path / "target")
    plan = _publish(run, store)
    assert "cu130" in plan.skipped and "build/cu130/x" in plan.skipped["cu130"]
    assert store.list("nightly/cu130") == [] and assert_index_consistent(store, "nightly/cpu/simple") == 1


def test_a_failed_required_test_without_variant_gates_every_variant() -> None:
    run = RunManifest(root=Path("."), run_id="r", units=[Unit("test/kernels", "test", "failed", required=True)])
    why = "failed or not run: test/kernels"
    assert gate(run, ["cu130", "cpu"]) == ([], {"cu130": why, "cpu": why})
    run.units.append(Unit("test/kernels", "test", "completed"))
    run.units.pop(0)
    assert gate(run, ["cu130"]) == (["cu130"], {})


def test_a_held_back_variant_names_its_first_five_blocking_units() -> None:
    units = [Unit(f"build/cu130/k{i}", "build", "failed", variant="cu130") for i in range(6)]
    run = RunManifest(root=Path("."), run_id="r", units=units)
    first_five = ", ".join(f"build/cu130/k{i}" for i in range(5))
    assert gate(run, ["cu130"]) == ([], {"cu130": f"failed or not run: {first_five} …"})
    run.units.pop()
    assert gate(run, ["cu130"])[1]["cu130"].endswith("build/cu130/k4")


def test_wheels_of_a_variant_kiln_toml_does_not_name_are_not_published_and_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0+cu130")], "rocm": [("k", "1.0+rocm")]})
    store = LocalStore(tmp_path / "target")
    with caplog.at_level(logging.WARNING, logger="kiln.release.publish.plan"):
        plan = publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
                       PublishSteps(clock=CLOCK))
    assert plan.keys("added") == ["nightly/cu130/simple/k/k-1.0+cu130-py3-none-any.whl"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "wheels of variants ['rocm'] are not in kiln.toml's variants ['cu130']; not published"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.release.publish.plan"):
        publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "rocm"]),
                PublishSteps(clock=CLOCK))
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []


class _AlwaysLosingRaces(LocalStore):
    """Fault injection: every page write loses its compare-and-swap, as under endless contention."""

    def put_page(self, key, data, content_type, cache_control, expected_etag):
        raise ConflictError(f"{key}: injected lost race")


def test_a_page_that_keeps_losing_its_race_stops_after_bounded_attempts_with_growing_backoff(tmp_path: Path) -> None:
    sleeps: list[float] = []
    dist = make_distribution("k-1.0-py3-none-any.whl", "a" * 64, 1, CLOCK())
    with pytest.raises(ConflictError, match="still changing"):
        update_pages(_AlwaysLosingRaces(tmp_path / "target"), "nightly/cu130/simple", [dist], sleep=sleeps.append)
    assert len(sleeps) == CAS_ATTEMPTS - 1  # no wait after the last attempt
    assert all(0.01 * 2**i <= s <= 0.05 * 2**i for i, s in enumerate(sleeps)), sleeps


def test_a_release_conflict_fails_its_upload_unit_saying_bump_the_version_once(tmp_path: Path) -> None:
    """Through the upload task the publish flow runs: the same file name with other bytes on the release channel."""
    from kiln.flows.publish import upload_wheel

    target = LocalStore(tmp_path / "target")
    first = make_run(tmp_path / "run1", {"cu130": [("k", "1.0")]})
    publish(first, target, PublishRequest(channel="release", channel_prefix="release", variants=["cu130"]),
            PublishSteps(clock=CLOCK))
    second = make_run(tmp_path / "run2", {"cu130": [("k", "1.0")]}, payload="other bytes")
    plan = publish(second, LocalStore(tmp_path / "staging"),
                   PublishRequest(channel="release", channel_prefix="release", variants=["cu130"]),
                   PublishSteps(clock=CLOCK))
    with pytest.raises(IntegrityError) as raised:
        upload_wheel.fn(target, plan.uploads[0], "release")
    message = str(raised.value)
    assert "already holds sha256" in message
    assert message.count("bump the version instead") == 1 and message.endswith("bump the version instead"), message
    present = upload_wheel.fn(target, publish(first, LocalStore(tmp_path / "s2"),
                                              PublishRequest(channel="release", channel_prefix="release",
                                                             variants=["cu130"]),
                                              PublishSteps(clock=CLOCK)).uploads[0],
                              "release")
    assert present.outcome == "present"


def test_a_wheel_changed_after_its_plan_with_its_metadata_intact_is_refused_at_upload(tmp_path: Path) -> None:
    """The planned wheel is rewritten between the plan and its upload with other module bytes and the same METADATA:
    its sha256 alone no longer matches, and the upload refuses it, writing nothing."""
    from kiln.release.publish.protocol import upload_file

    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0")]}, payload="planned")
    plan = publish(run, LocalStore(tmp_path / "staging"),
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
                   PublishSteps(clock=CLOCK))
    (upload,) = plan.uploads
    make_wheel(upload.source.parent, "k", "1.0", payload="swapped after the plan")  # same name, same METADATA
    target = LocalStore(tmp_path / "target")
    with pytest.raises(IntegrityError, match="changed after it was verified"):
        upload_file(target, upload)
    assert not (tmp_path / "target").exists() or not any((tmp_path / "target").rglob("*.whl"))


def test_manifest_hash_mismatch_refuses_and_writes_nothing(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("a", "1.0"), ("b", "1.0")]})
    (tmp_path / "run" / run.artifacts[1].path).write_bytes(b"tampered")
    with pytest.raises(IntegrityError, match="does not match"):
        _publish(run, LocalStore(tmp_path / "target"))
    assert not (tmp_path / "target").exists()


def test_manifest_path_traversal_is_refused(tmp_path: Path) -> None:
    make_run(tmp_path / "run", {"cu130": [("a", "1.0")]})
    data = json.loads((tmp_path / "run" / "run.json").read_text())
    data["artifacts"][0]["path"] = "../outside.whl"
    (tmp_path / "run" / "run.json").write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="outside.whl"):
        RunManifest.load(tmp_path / "run")


def test_same_filename_with_other_bytes_is_a_conflict_left_off_the_pages(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "target")
    _publish(make_run(tmp_path / "a", {"cu130": [("k", "1.0")]}, payload="first"), store)
    before = _snapshot(tmp_path / "target")
    plan = _publish(make_run(tmp_path / "b", {"cu130": [("k", "1.0"), ("j", "2.0")]}, payload="second"), store)
    assert plan.keys("conflict") == ["nightly/cu130/simple/k/k-1.0-py3-none-any.whl"]
    after = _snapshot(tmp_path / "target")
    published = [k for k in before if not k.endswith(("/index.html", "/index.json"))]
    assert published and all(after[k] == before[k] for k in published)  # nothing published was overwritten
    wheel = "nightly/cu130/simple/k/k-1.0-py3-none-any.whl"
    assert after[wheel] == before[wheel]
    assert assert_index_consistent(store, "nightly/cu130/simple") == 2


@pytest.mark.parametrize("wheel_present", [False, True], ids=["sidecar-only", "wheel-and-sidecar"])
def test_an_existing_sidecar_with_other_bytes_is_an_integrity_error_and_no_page_is_written(
    tmp_path: Path, wheel_present: bool
) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0")]})
    store = LocalStore(tmp_path / "target")
    sidecar = plant_sidecar_with_other_bytes(run, store, "nightly/cu130/simple", wheel_present)
    before = _snapshot(tmp_path / "target")
    with pytest.raises(IntegrityError, match=re.escape(sidecar)):
        _publish(run, store)
    assert page_keys(store) == []  # a page would advertise a core-metadata hash the sidecar does not have
    assert _snapshot(tmp_path / "target")[sidecar] == before[sidecar]


@pytest.mark.parametrize("suffix", [".whl", ".whl.metadata"])
def test_a_read_back_that_differs_from_the_upload_is_an_integrity_error_and_nothing_is_listed(
    tmp_path: Path, suffix: str
) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0")]})
    store = CorruptingStore(LocalStore(tmp_path / "target"), suffix)  # fault injection: damages bytes on write
    with pytest.raises(IntegrityError, match="k-1.0-py3-none-any"):
        _publish(run, store)
    assert store.corrupted == [f"nightly/cu130/simple/k/k-1.0-py3-none-any{suffix}"]
    assert page_keys(store) == []


def test_dry_run_plans_against_staging_and_leaves_the_target_untouched(tmp_path: Path) -> None:
    target = LocalStore(tmp_path / "target")
    _publish(make_run(tmp_path / "a", {"cu130": [("k", "1.0")]}, payload="first"), target)
    before = _snapshot(tmp_path / "target")
    run = make_run(tmp_path / "b", {"cu130": [("k", "1.0"), ("k", "2.0")]}, payload="first")
    staging = StagingStore(target, tmp_path / "staging")
    plan = _publish(run, staging, dry_run=True)
    assert _snapshot(tmp_path / "target") == before
    assert plan.keys("present") == ["nightly/cu130/simple/k/k-1.0-py3-none-any.whl"]
    assert plan.keys("added") == ["nightly/cu130/simple/k/k-2.0-py3-none-any.whl"]
    assert set(plan.pages) == {"nightly/cu130/simple/k/index.html", "nightly/cu130/simple/k/index.json"}
    assert "would change" in plan.to_markdown() and "k-2.0-py3-none-any.whl" in plan.to_markdown()
    assert assert_index_consistent(staging, "nightly/cu130/simple") == 2
    assert "(nightly, dry run)" in plan.to_markdown()
    plan.dry_run, plan.preview = False, True  # what a real release's approver reads: ahead of time, not a dry run
    text = plan.to_markdown()
    assert "(nightly, preview)" in text and "dry run" not in text and "- to add: 1" in text and "would change" in text


def test_concurrent_publishers_into_one_directory_lose_no_entry(tmp_path: Path) -> None:
    runs = [make_run(tmp_path / f"r{i}", {"cu130": [("k", f"1.{i}")]}) for i in range(5)]

    errors = run_at_once(lambda run: _publish(run, LocalStore(tmp_path / "target")), runs)

    assert errors == []
    assert assert_index_consistent(LocalStore(tmp_path / "target"), "nightly/cu130/simple") == 5
