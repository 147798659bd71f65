"""Fixtures for release tests: moto's S3 server on loopback (server mode, real HTTP)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import boto3
import pytest

from kiln.core.s3 import S3Store, make_client
from tests.helpers.s3 import S3_ENV

_bucket_numbers = itertools.count()


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
