"""Benchmark history in the artifact store: keys, immutability, `last`, S3."""

from __future__ import annotations

import logging
from pathlib import Path

import boto3
import pytest

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.record import create_record
from kiln.tasks.bench.history import (
    check_compare,
    history_key,
    history_with,
    last_nightly,
    load_history,
    open_history,
    parse_compare,
    resolve_baseline,
    store_if,
)
from kiln.tasks.bench.results import parse_time, save_results
from kiln.tasks.bench.trust import HistoryReader
from kiln.tasks.project.config import load_config
from kiln.tasks.run.runs import artifact_store
from tests.helpers.benchfakes import FakeTimer, fake_run, keep, run_header


def _run(run_id: str, created: str, flow: str = "nightly", variant: str = "cpu", seed: int = 1):
    return fake_run(FakeTimer(seed=seed), run_id=run_id, flow=flow, variant=variant, created=created)


def _reader(store, until: str = "2026-12-01T00:00:00Z") -> HistoryReader:
    """History as a run that started at ``until`` reads it."""
    return HistoryReader(store, parse_time(until))


@pytest.fixture
def config(benchproj: Path):
    return load_config(benchproj)


def test_results_are_stored_under_the_history_prefix_by_time_and_run(config):
    store = artifact_store(config)
    key = keep(store, config, _run("abc-123", "2026-11-29T03:04:05Z"))
    assert key == "bench-history/20261129T030405Z-abc-123.json"
    assert (config.root / "artifacts" / key).is_file()  # file:// is relative to kiln.toml


def test_a_run_id_cannot_smuggle_a_path_into_the_key(config):
    key = history_key(config, run_header(_run("../../etc/passwd", "2026-11-29T03:04:05Z")))
    assert key.startswith("bench-history/") and ".." not in key and key.count("/") == 1


def test_stored_results_are_immutable(config):
    store = artifact_store(config)
    results = _run("r1", "2026-11-29T03:04:05Z")
    keep(store, config, results)
    keep(store, config, results)  # same bytes again: a retried task is harmless
    with pytest.raises(IntegrityError):
        keep(store, config, _run("r1", "2026-11-29T03:04:05Z", seed=2))


def test_last_is_the_newest_nightly_of_the_same_variant_and_metric(config):
    store = artifact_store(config)
    for results in (
        _run("old-nightly", "2026-11-27T03:00:00Z"),
        _run("new-nightly", "2026-11-28T03:00:00Z"),
        _run("ad-hoc", "2026-11-28T12:00:00Z", flow="bench"),
        _run("gpu-nightly", "2026-11-28T13:00:00Z", variant="cu130"),
    ):
        keep(store, config, results)
    found = last_nightly(_reader(store), config, variant="cpu", metric="cpu")
    assert found is not None and found.run_id == "new-nightly"
    again = last_nightly(_reader(store), config, variant="cpu", metric="cpu", exclude_run="new-nightly")
    assert again is not None and again.run_id == "old-nightly"
    assert last_nightly(_reader(store), config, variant="rocm", metric="cpu") is None


def test_a_corrupt_history_entry_is_skipped_with_a_warning(config, caplog):
    store = artifact_store(config)
    keep(store, config, _run("good", "2026-11-27T03:00:00Z"))
    store.put_immutable("bench-history/20261128T030000Z-bad.json", b"{broken", "application/json", "no-cache")
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.bench.history"):
        found = last_nightly(_reader(store), config, variant="cpu", metric="cpu")
    assert found is not None and found.run_id == "good"
    assert "20261128T030000Z-bad.json" in caplog.text


def test_history_is_oldest_first_and_ends_with_the_current_run(config):
    store = artifact_store(config)
    for day in (25, 26, 27):
        keep(store, config, _run(f"n{day}", f"2026-11-{day}T03:00:00Z"))
    history = history_with(_reader(store), config, _run("now", "2026-11-29T03:00:00Z"))
    assert [r.run_id for r in history] == ["n25", "n26", "n27", "now"]
    assert [r.run_id for r in load_history(_reader(store), config, variant="cpu", metric="cpu", limit=2)] == ["n26", "n27"]


def test_resolve_baseline_reads_a_file_or_the_last_nightly_or_nothing(config, tmp_path):
    store = artifact_store(config)
    current = _run("now", "2026-11-29T03:00:00Z")
    assert resolve_baseline(parse_compare(None), current, config, _reader(store)) is None
    assert resolve_baseline(parse_compare("last"), current, config, _reader(store)) is None  # first night: nothing yet
    keep(store, config, _run("n1", "2026-11-28T03:00:00Z"))
    assert resolve_baseline(parse_compare("last"), current, config, _reader(store)).run_id == "n1"
    path = save_results(_run("file", "2026-11-01T00:00:00Z"), tmp_path / "base.json")
    assert resolve_baseline(parse_compare(str(path)), current, config, _reader(store)).run_id == "file"
    with pytest.raises(InvalidInputError, match="does not exist"):
        resolve_baseline(parse_compare(str(tmp_path / "nope.json")), current, config, _reader(store))
    with pytest.raises(InvalidInputError, match="artifact store"):
        resolve_baseline(parse_compare("last"), current, config, None)


def test_compare_is_checked_before_anything_is_measured(tmp_path):
    check_compare(parse_compare(None))
    check_compare(parse_compare("last"))
    with pytest.raises(InvalidInputError, match="does not exist"):
        check_compare(parse_compare(str(tmp_path / "missing.json")))


def test_store_if_says_what_it_did(config):
    results = _run("r", "2026-11-29T03:00:00Z")
    store, header = artifact_store(config), run_header(results)
    create_record(store, header, config.root / "views")
    assert "store_history is off" in store_if(False, store, config, results, header)
    assert "could not be opened" in store_if(True, None, config, results, header)
    assert store_if(True, store, config, results, header).startswith("stored as bench-history/")
    again = results.model_copy(update={"cases": results.cases[:1]})  # a second benchmark of the same run
    assert store_if(True, store, config, again, header).startswith("history not stored: run r already has other")


def _s3_config(benchproj: Path, endpoint: str, bucket: str):
    text = benchproj.read_text().replace(
        'url = "file://artifacts"', f'url = "s3://{bucket}/kiln"\nregion = "us-east-1"\nendpoint = "{endpoint}"')
    benchproj.write_text(text)
    return load_config(benchproj)


def test_history_round_trips_through_s3_on_loopback(benchproj, s3_endpoint):
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    session.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="bench-history-test")
    config = _s3_config(benchproj, s3_endpoint, "bench-history-test")
    asked = []
    store = open_history(config, session_factory=lambda: asked.append("bench") or session)
    assert asked == ["bench"], "an s3:// store must use the bench step's session"
    keep(store, config, _run("n1", "2026-11-27T03:00:00Z"))
    keep(store, config, _run("n2", "2026-11-28T03:00:00Z"))
    keys = session.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket="bench-history-test")["Contents"]
    assert sorted(k["Key"] for k in keys if "/runs/" not in k["Key"]) == ["kiln/bench-history/20261127T030000Z-n1.json",
                                              "kiln/bench-history/20261128T030000Z-n2.json"]
    assert last_nightly(_reader(store), config, variant="cpu", metric="cpu").run_id == "n2"


def test_a_local_store_needs_no_credentials(config):
    def no_session():  # fault injection: asking for credentials would be a bug here
        raise AssertionError("a file:// store must not ask for credentials")

    assert open_history(config, session_factory=no_session) is not None
