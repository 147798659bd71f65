"""The publish protocol against moto's S3 server on loopback: crashes, races, throttling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import IntegrityError
from kiln.core.s3 import S3Store, make_client
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from tests.helpers.faults import echo_checksums, inject_throttling
from tests.helpers.runkit import make_run, run_at_once
from tests.helpers.s3 import S3_ENV

from .test_publish_local import assert_index_consistent, page_keys, plant_sidecar_with_other_bytes

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120
INDEXES = ("nightly/cu130/simple", "nightly/cpu/simple")


def _child(endpoint: str, bucket: str, run: Path, kill_after: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO)}
    if kill_after is not None:
        env["KILN_TEST_KILL_AFTER_REQUESTS"] = str(kill_after)
    return subprocess.run(
        [sys.executable, "-m", "tests.release.publisher_child", "--endpoint", endpoint, "--bucket", bucket,
         "--run", str(run)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=REPO,
    )


def _store(endpoint: str, session: Any, bucket: str) -> S3Store:
    return S3Store(make_client(session, "us-east-1", endpoint), bucket, "site")


def _publish(run, store: S3Store):
    return publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"]),
                   PublishSteps(clock=lambda: 1_700_000_000.0))


def _fresh(endpoint: str, session: Any, bucket: str) -> S3Store:
    make_client(session, "us-east-1", endpoint).create_bucket(Bucket=bucket)
    return _store(endpoint, session, bucket)


@pytest.mark.slow
def test_sigkill_at_many_points_leaves_a_consistent_index_and_a_rerun_completes(
    tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    base = make_run(tmp_path / "base",
                    {"cu130": [("kiln-kernels", "0.1.0+cu130")], "cpu": [("kiln-kernels", "0.1.0+cpu")]})
    run = make_run(tmp_path / "new", {"cu130": [("kiln-kernels", "0.2.0+cu130"), ("extra", "1.0")],
                                      "cpu": [("kiln-kernels", "0.2.0+cpu")]})
    _publish(base, _store(s3_endpoint, s3_session, s3_bucket))
    probe = _child(s3_endpoint, s3_bucket, run.root)  # how many requests a complete publish makes
    assert probe.returncode == 0, probe.stderr[-2000:]
    total = json.loads(probe.stdout)["requests"]
    points = sorted({1, 3, total // 4, total // 2, (3 * total) // 4, total - 3, total - 1})
    for n, point in enumerate(points):
        store = _fresh(s3_endpoint, s3_session, f"{s3_bucket}-k{n}")
        _publish(base, store)
        killed = _child(s3_endpoint, store.bucket, run.root, kill_after=point)
        assert killed.returncode == -9, f"kill point {point}: {killed.returncode} {killed.stderr[-2000:]}"
        for index in INDEXES:
            assert assert_index_consistent(store, index, settled=False) >= 1  # the base wheel is never lost
        rerun = _publish(run, store)
        assert assert_index_consistent(store, "nightly/cu130/simple") == 3
        assert assert_index_consistent(store, "nightly/cpu/simple") == 2
        again = _publish(run, store)
        assert again.keys("added") == [] and again.pages == []  # nothing uploaded, no page rewritten
        assert len(rerun.keys("added")) + len(rerun.keys("present")) == 3


@pytest.mark.slow
def test_two_publisher_processes_at_once_are_both_listed(
    tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    runs = [make_run(tmp_path / f"r{i}",
                     {"cu130": [("kiln-kernels", f"0.{i}.0+cu130")], "cpu": [("kiln-kernels", f"0.{i}.0+cpu")]})
            for i in range(3)]
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.release.publisher_child", "--endpoint", s3_endpoint,
                               "--bucket", s3_bucket, "--run", str(r.root)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in runs]
    for proc in procs:
        _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        assert proc.returncode == 0, err[-2000:]
    store = _store(s3_endpoint, s3_session, s3_bucket)
    assert assert_index_consistent(store, "nightly/cu130/simple") == 3
    assert assert_index_consistent(store, "nightly/cpu/simple") == 3


def test_concurrent_publishers_in_threads_lose_no_entry(
    tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    runs = [make_run(tmp_path / f"r{i}", {"cu130": [("kiln-kernels", f"1.{i}")]}) for i in range(6)]
    # a client per publisher, as separate jobs would have
    publishers = [(run, _store(s3_endpoint, s3_session, s3_bucket)) for run in runs]

    errors = run_at_once(
        lambda pair: publish(pair[0], pair[1],
                             PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
                             PublishSteps(clock=lambda: 1.7e9)),
        publishers,
    )

    assert errors == []
    assert assert_index_consistent(_store(s3_endpoint, s3_session, s3_bucket), "nightly/cu130/simple") == 6


@pytest.mark.slow
def test_publish_completes_with_throttling_on_a_fraction_of_calls(
    tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("a", "1.0"), ("b", "1.0"), ("c", "1.0")]})
    store = _store(s3_endpoint, s3_session, s3_bucket)
    hits = inject_throttling(store.client, fraction=0.25, seed=7)
    plan = publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
                   PublishSteps(clock=lambda: 1.7e9))
    assert hits[0] > 0 and len(plan.keys("added")) == 3
    assert assert_index_consistent(_store(s3_endpoint, s3_session, s3_bucket), "nightly/cu130/simple") == 3


def test_an_existing_s3_sidecar_with_other_bytes_is_an_integrity_error_and_no_page_is_written(
    tmp_path: Path, s3_store: S3Store
) -> None:
    run = make_run(tmp_path / "run", {"cu130": [("k", "1.0")]})
    sidecar = plant_sidecar_with_other_bytes(run, s3_store, "nightly/cu130/simple", wheel_present=True)
    with pytest.raises(IntegrityError, match=re.escape(sidecar)):
        _publish(run, s3_store)
    assert page_keys(s3_store) == []


def test_adding_a_wheel_on_a_store_that_verifies_checksums_sends_no_head_and_reads_nothing_back(
    tmp_path: Path, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    store = _store(s3_endpoint, s3_session, s3_bucket)
    store.verifies_checksums = True
    echo_checksums(store.client)  # simulation: the echo AWS sends after verifying; moto sends none
    _publish(make_run(tmp_path / "a", {"cu130": [("demo", "1.0")]}), store)
    sent: Counter[str] = Counter()
    store.client.meta.events.register("before-send.s3",
                                      lambda event_name, **_: sent.update([event_name.rsplit(".", 1)[-1]]))
    plan = _publish(make_run(tmp_path / "b", {"cu130": [("demo", "2.0")]}), store)
    assert len(plan.keys("added")) == 1
    # wheel and sidecar: one PUT each; project pages: 2 reads + 2 CAS writes; root: 2 reads, unchanged
    assert sent == {"PutObject": 4, "GetObject": 4}
    assert assert_index_consistent(_store(s3_endpoint, s3_session, s3_bucket), "nightly/cu130/simple") == 2
