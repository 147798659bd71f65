"""The generated policies hold under IAM enforcement (moto S3/IAM/STS on loopback).

Users and a role are created from ``kiln policies`` output, enforcement is
switched on, and each step's credentials are tried against every prefix.
"""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import ClientError

from kiln.core.errors import ConfigError
from kiln.core.s3 import S3Store
from kiln.flows.run.credentials import session_for
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.publish.prune import Retention, prune
from kiln.release.stores.policies import policies_from_config, render
from kiln.tasks.build.ccache_bridge import Bridge
from kiln.tasks.build.compile_tier import COMPILE_PREFIX
from kiln.tasks.project.config_build import BuildCacheSettings
from tests.helpers.moto_iam import BUCKET, kiln_config
from tests.helpers.runkit import make_run

pytestmark = pytest.mark.slow

PREFIXES = ("artifacts/", "bench-history/", "nightly/", "release/")
WORKER_POLICY = {"Version": "2012-10-17",
                 "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}]}


def _as_moto_evaluates(document: dict) -> dict:
    """The policy as moto can judge it: its ListBucket allow spelled the way moto names the call, and
    without the ``s3:prefix`` condition — moto's gaps, not Kiln's.

    moto (5.2) checks a ListObjectsV2 request against the action ``s3:ListObjectsV2`` (AWS: ``s3:ListBucket``),
    and (since 5.1.4) evaluates a statement's Condition without ever supplying the ``s3:prefix`` context key,
    so it denies every prefix-scoped list that AWS allows. The generated document's condition is checked as
    written in tests/permissions/test_policies.py; here moto enforces the object permissions (reads, writes,
    deletes and the explicit denies).
    """
    statements = []
    for statement in document["Statement"]:
        if statement.get("Action") == ["s3:ListBucket"] and statement.get("Effect") == "Allow":
            statement = {**{k: v for k, v in statement.items() if k != "Condition"},
                         "Action": ["s3:ListBucket", "s3:ListObjectsV2"]}
        statements.append(statement)
    return {**document, "Statement": statements}


@pytest.fixture(scope="module")
def enforced(moto_server):
    """Bucket, one user per step, a role for publish-release; then enforcement on."""
    s3, iam = moto_server.admin("s3"), moto_server.admin("iam")
    s3.create_bucket(Bucket=BUCKET)
    for prefix in PREFIXES:
        s3.put_object(Bucket=BUCKET, Key=f"simple/{prefix}seed.txt", Body=b"seed")
    config = kiln_config(moto_server.url, {})
    # with the unit cache's shared tier in the artifact store, whose prefix only the build writes
    config = config.model_copy(update={"build": config.build.model_copy(
        update={"cache": BuildCacheSettings(remote="artifacts")})})
    for step, document in policies_from_config(config).items():
        iam.create_user(UserName=f"kiln-{step}")
        iam.put_user_policy(UserName=f"kiln-{step}", PolicyName="kiln",
                            PolicyDocument=render(_as_moto_evaluates(document)))
        key = iam.create_access_key(UserName=f"kiln-{step}")["AccessKey"]
        moto_server.users[step] = {"aws_access_key_id": key["AccessKeyId"],
                                   "aws_secret_access_key": key["SecretAccessKey"]}
    worker = iam.create_user(UserName="worker")["User"]["Arn"]
    iam.put_user_policy(UserName="worker", PolicyName="assume", PolicyDocument=json.dumps(WORKER_POLICY))
    key = iam.create_access_key(UserName="worker")["AccessKey"]
    moto_server.users["worker"] = {"aws_access_key_id": key["AccessKeyId"],
                                   "aws_secret_access_key": key["SecretAccessKey"]}
    trust = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": worker}, "Action": "sts:AssumeRole"}]}
    role = iam.create_role(RoleName="kiln-publish-release", AssumeRolePolicyDocument=json.dumps(trust))["Role"]
    iam.put_role_policy(RoleName="kiln-publish-release", PolicyName="kiln",
                        PolicyDocument=render(policies_from_config(config)["publish-release"]))
    moto_server.enforce()
    return moto_server, role["Arn"]


def _code(call) -> str:
    try:
        call()
    except ClientError as exc:
        return exc.response["Error"]["Code"]
    return "OK"


def _put(s3, prefix: str):
    return lambda: s3.put_object(Bucket=BUCKET, Key=f"simple/{prefix}new.txt", Body=b"x")


def test_enforcement_is_on(enforced):
    server, _ = enforced
    anonymous = server.admin("s3")  # keys that belong to no IAM user
    assert _code(lambda: anonymous.get_object(Bucket=BUCKET, Key="simple/release/seed.txt")) != "OK"


@pytest.mark.parametrize("step", ["build", "test", "bench"])
def test_build_test_bench_cannot_write_any_index_or_delete(enforced, step):
    server, _ = enforced
    s3 = server.client_as(step)
    assert _code(_put(s3, "nightly/")) == "AccessDenied"
    assert _code(_put(s3, "release/")) == "AccessDenied"
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="simple/artifacts/seed.txt")) == "AccessDenied"
    own = "bench-history/" if step == "bench" else "artifacts/"
    assert _code(_put(s3, own)) == "OK"  # the box is not simply empty


def test_nightly_publisher_is_denied_release_prefix_delete_and_bucket_settings(enforced):
    server, _ = enforced
    s3 = server.client_as("publish-nightly")
    assert _code(_put(s3, "nightly/")) == "OK"
    assert _code(lambda: s3.get_object(Bucket=BUCKET, Key="simple/nightly/seed.txt")) == "OK"
    assert _code(_put(s3, "release/")) == "AccessDenied"
    assert _code(lambda: s3.get_object(Bucket=BUCKET, Key="simple/release/seed.txt")) == "AccessDenied"
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="simple/nightly/seed.txt")) == "AccessDenied"
    assert _code(lambda: s3.put_bucket_versioning(
        Bucket=BUCKET, VersioningConfiguration={"Status": "Suspended"})) == "AccessDenied"


def test_release_publisher_succeeds_on_its_prefix_only(enforced):
    server, _ = enforced
    s3 = server.client_as("publish-release")
    assert _code(_put(s3, "release/")) == "OK"
    assert s3.get_object(Bucket=BUCKET, Key="simple/release/new.txt")["Body"].read() == b"x"
    assert _code(_put(s3, "nightly/")) == "AccessDenied"
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="simple/release/new.txt")) == "AccessDenied"


def test_the_prune_step_deletes_nightly_objects_only(enforced, tmp_path):
    server, _ = enforced
    publisher = S3Store(server.client_as("publish-nightly"), BUCKET, "simple")
    for n in (1, 2):
        run = make_run(tmp_path / f"run{n}", {"cpu": [("demo", f"1.0.dev{n}")]})
        publish(run, publisher,
                PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"], commit=f"{n}" * 40),
                PublishSteps(clock=lambda: 1_700_000_000.0))
    s3 = server.client_as("prune-nightly")
    plan = prune(S3Store(s3, BUCKET, "simple"), channel="nightly", channel_prefix="nightly",
                 retention=Retention(1, 0))
    assert "nightly/cpu/simple/demo/demo-1.0.dev1-py3-none-any.whl" in plan.deleted  # under enforcement
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="simple/release/seed.txt")) == "AccessDenied"
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="simple/artifacts/seed.txt")) == "AccessDenied"
    assert _code(lambda: s3.delete_object(Bucket=BUCKET, Key="nightly/outside.txt")) == "AccessDenied"
    assert _code(_put(s3, "release/")) == "AccessDenied"
    assert _code(lambda: s3.put_bucket_versioning(
        Bucket=BUCKET, VersioningConfiguration={"Status": "Suspended"})) == "AccessDenied"
    # Only the prune step deletes: the publisher of the same channel still cannot.
    assert _code(lambda: publisher.client.delete_object(Bucket=BUCKET, Key="simple/nightly/seed.txt")) \
        == "AccessDenied"


def test_session_for_assumes_the_step_role(enforced, monkeypatch):
    server, role_arn = enforced
    # boto3's default session resolved other keys first (as an earlier command of a daemon would): it caches
    # them, and the worker's keys set afterwards must still be the ones that call STS.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stale")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "stale")
    boto3.client("sts", region_name="us-east-1", endpoint_url=server.url)  # resolves and caches "stale"
    for name, value in server.users["worker"].items():
        monkeypatch.setenv(name.upper(), value)
    config = kiln_config(server.url, {"publish-release": {"role_arn": role_arn}})
    session = session_for(config, "publish-release")
    s3 = session.client("s3", endpoint_url=server.url)
    assert _code(_put(s3, "release/")) == "OK"
    assert _code(_put(s3, "nightly/")) == "AccessDenied"
    # The worker's own keys cannot write anything: the role is what grants it.
    assert _code(_put(server.client_as("worker"), "release/")) == "AccessDenied"


def test_only_the_build_writes_the_build_ledger_and_only_the_release_publisher_the_release_baseline(enforced):
    server, _ = enforced
    assert _code(_put(server.client_as("build"), "artifacts/build-ledger/")) == "OK"
    assert _code(_put(server.client_as("test"), "artifacts/")) == "OK"
    assert _code(_put(server.client_as("test"), "artifacts/build-ledger/")) == "AccessDenied"
    assert _code(_put(server.client_as("bench"), "bench-history/")) == "OK"
    assert _code(_put(server.client_as("bench"), "bench-history/published/")) == "AccessDenied"
    assert _code(_put(server.client_as("publish-release"), "bench-history/published/")) == "OK"


def test_only_the_build_writes_the_shared_build_cache_and_the_test_step_reads_it(enforced):
    server, _ = enforced
    assert _code(_put(server.client_as("build"), "artifacts/build-cache/objects/")) == "OK"
    for step in ("test", "bench", "publish-nightly", "publish-release"):
        assert _code(_put(server.client_as(step), "artifacts/build-cache/objects/")) == "AccessDenied", step
    read = server.client_as("test").get_object(Bucket=BUCKET, Key="simple/artifacts/build-cache/objects/new.txt")
    assert read["Body"].read()


def test_only_the_build_role_writes_the_compile_cache_and_a_reading_role_degrades_to_reads(enforced):
    server, _ = enforced
    where = f"build-cache/{COMPILE_PREFIX}"
    builder = Bridge(S3Store(server.client_as("build"), BUCKET, "simple/artifacts"), where)
    assert builder.put(b"\x0a\x0b", b"an object file") and builder.stats.written == 1
    reader = Bridge(S3Store(server.client_as("test"), BUCKET, "simple/artifacts"), where)
    assert not reader.put(b"\x0c", b"a planted object") and reader.stats.read_only  # IAM refused it
    assert reader.get(b"\x0a\x0b") == b"an object file" and not reader.stats.unreachable
    assert builder.get(b"\x0c") is None  # nothing was planted


def test_session_for_names_a_missing_permissions_entry(enforced):
    server, _ = enforced
    config = kiln_config(server.url, {})
    with pytest.raises(ConfigError, match=r"no \[permissions.deploy\]"):
        session_for(config, "deploy")
