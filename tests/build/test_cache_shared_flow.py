"""Two workers, one store: build_flow on two clones of the tiny project, each with its own local cache and
one moto S3 artifact store whose shared tier ([build.cache] remote = "artifacts") they both use."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import boto3
import pytest

from kiln.core.manifest import RunManifest
from kiln.core.s3 import make_client
from tests.helpers.projects import copy_project
from tests.helpers.s3 import S3_ENV

pytestmark = pytest.mark.slow

VERSION = "0.1.0.dev20261129"
_buckets = itertools.count()
SHARED = """
[build.cache]
remote = "artifacts"

[artifacts]
url = "s3://{bucket}/artifacts"
endpoint = "{endpoint}"
region = "us-east-1"

[permissions.build]
read = ["artifacts/"]
write = ["artifacts/"]
credentials = {{ ambient = true }}
"""


def _clone(root: Path, name: str, bucket: str, endpoint: str) -> Path:
    """A worker's clone of the project: its own directory, so its own local cache (.kiln/cache)."""
    config = copy_project("tiny", root / name)
    config.write_text(config.read_text() + SHARED.format(bucket=bucket, endpoint=endpoint))
    return config


def _build(config: Path, out: Path) -> tuple[Any, RunManifest]:
    from kiln.flows.build import build_flow

    state = build_flow(str(config), str(out), version=VERSION, return_state=True)
    return state, RunManifest.load(out / str(state.state_details.flow_run_id))


def _caches(run: RunManifest) -> dict[str, str]:
    return {u.id: u.cache for u in run.units if u.cache}


def _wheels(run: RunManifest) -> dict[str, str]:
    return {Path(a.path).name: a.sha256 for a in run.artifacts_of("wheel")}


@pytest.fixture(scope="module")
def store(s3_endpoint: str) -> tuple[Any, str, str]:
    session = boto3.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    client = make_client(session, "us-east-1", s3_endpoint)
    bucket = f"kiln-shared-cache-{os.getpid()}-{next(_buckets)}"
    client.create_bucket(Bucket=bucket)
    return client, bucket, s3_endpoint


@pytest.fixture(scope="module")
def first(prefect_server, store, tmp_path_factory) -> tuple[Path, RunManifest]:
    _, bucket, endpoint = store
    root = tmp_path_factory.mktemp("workers")
    state, run = _build(_clone(root, "first", bucket, endpoint), root / "out-first")
    assert state.is_completed()
    return root, run


def test_the_first_worker_compiles_and_fills_the_shared_tier(first, store):
    client, bucket, _ = store
    _, run = first
    assert set(_caches(run).values()) == {"miss"} and len(_caches(run)) == 4
    assert run.info["build_cache_shared"]["written"] == 4
    entries = client.list_objects_v2(Bucket=bucket, Prefix="artifacts/build-cache/entries/")["KeyCount"]
    assert entries == 4  # the units only: wheels and audits stay in each worker's own tier


def test_a_second_worker_compiles_nothing_and_writes_the_same_wheels(first, store):
    _, bucket, endpoint = store
    root, run = first
    state, second = _build(_clone(root, "second", bucket, endpoint), root / "out-second")
    assert state.is_completed()
    assert set(_caches(second).values()) == {"hit"} and len(_caches(second)) == 4  # zero compilations
    shared = second.info["build_cache_shared"]
    assert (shared["hits"], shared["misses"], shared["rejected"], shared["written"]) == (4, 0, 0, 0)
    assert _wheels(second) == _wheels(run) and len(_wheels(run)) == 3


def test_damaged_and_forged_shared_objects_are_rebuilt_and_the_wheels_stay_right(first, store):
    client, bucket, _ = store
    root, run = first
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="artifacts/build-cache/objects/")
               ["Contents"]]
    cubins = [k for k in objects if client.get_object(Bucket=bucket, Key=k)["Body"].read().startswith(b"\x7fELF")]
    torn, forged = sorted(cubins)[:2]
    body = client.get_object(Bucket=bucket, Key=forged)["Body"].read()
    # Written around the create-only protocol, as a torn upload or a forger with the bucket's keys would.
    client.put_object(Bucket=bucket, Key=torn, Body=client.get_object(Bucket=bucket, Key=torn)["Body"].read()[:100])
    client.put_object(Bucket=bucket, Key=forged, Body=body[:-4] + b"EVIL")
    state, third = _build(_clone(root, "third", bucket, store[2]), root / "out-third")
    assert state.is_completed()
    caches = _caches(third)
    assert list(caches.values()).count("miss") == 2 and list(caches.values()).count("hit") == 2
    assert third.info["build_cache_shared"]["rejected"] == 2
    assert _wheels(third) == _wheels(run)


def test_an_unreachable_shared_tier_is_a_warning_and_a_green_local_build(tmp_path, caplog):
    """The build stage's own functions, with the shared tier's store on a port nothing listens on."""
    import logging
    import socket

    from botocore.config import Config

    from kiln.core.s3 import S3Store
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import build_unit
    from kiln.tasks.project.config import load_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # One attempt per call: botocore's own backoff on a refused port is not what this tests.
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{port}",
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2))
    config = copy_project("tiny", tmp_path)
    config.write_text(config.read_text() + '\n[build.cache]\nremote = "artifacts"\n')
    setup = prepare_build(load_config(config), VERSION, ["cu130"], store=S3Store(client, "nowhere", "artifacts"))
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.cache_remote"):
        with compile_context(setup, tmp_path / "out") as env:
            outcomes = {u.id: build_unit(u, env) for u in setup.plan.units}
        (variant,) = setup.plan.variants
        output = assemble_variant(setup, variant, outcomes, tmp_path / "out")  # type: ignore[arg-type]
    assert output.unit.state == "completed" and any(kind == "wheel" for _, kind in output.files)
    assert {r.cache for r in outcomes.values()} == {"miss"} and len(outcomes) == 3
    assert setup.remote is not None and setup.remote.stats.unreachable
    assert caplog.text.count("did not answer") == 1
