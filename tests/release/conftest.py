"""Fixtures for release tests: moto's S3 server on loopback (server mode, real HTTP)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from release.s3 import S3Store, make_client

_bucket_numbers = itertools.count()

# moto accepts any credentials; set them so boto3 never looks for real ones.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server bound to 127.0.0.1 on an ephemeral port."""
    from moto.server import ThreadedMotoServer

    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_session() -> Any:
    return boto3.Session(
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_ENV["AWS_DEFAULT_REGION"],
    )


@pytest.fixture
def s3_bucket(s3_endpoint: str, s3_session: Any) -> str:
    """A fresh, empty bucket for one test."""
    name = f"kiln-test-{os.getpid()}-{next(_bucket_numbers)}"
    make_client(s3_session, "us-east-1", s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_store(s3_endpoint: str, s3_session: Any, s3_bucket: str) -> S3Store:
    return S3Store(make_client(s3_session, "us-east-1", s3_endpoint), s3_bucket, "simple")
