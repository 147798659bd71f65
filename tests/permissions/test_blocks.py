"""Credentials from Prefect AwsCredentials blocks, and what happens without one."""

from __future__ import annotations

import uuid

import pytest

from kiln.core.errors import ConfigError
from kiln.flows.run.credentials import session_for
from tests.helpers.moto_iam import kiln_config


@pytest.fixture
def secret() -> str:
    return f"kiln-secret-{uuid.uuid4().hex}"


def test_block_credentials_become_the_step_session(prefect_server, secret, kiln_log):
    from prefect_aws import AwsCredentials

    name = f"kiln-build-{uuid.uuid4().hex[:8]}"
    AwsCredentials(aws_access_key_id="AKIAKILNBUILD", aws_secret_access_key=secret,
                   region_name="us-east-1").save(name)
    config = kiln_config("http://127.0.0.1:1", {"build": {"block": name}})
    session = session_for(config, "build")
    frozen = session.get_credentials().get_frozen_credentials()
    assert (frozen.access_key, frozen.secret_key) == ("AKIAKILNBUILD", secret)
    assert name in kiln_log.text
    assert secret not in kiln_log.text


def test_missing_block_is_a_config_error_naming_it(prefect_server):
    config = kiln_config("http://127.0.0.1:1", {"test": {"block": "no-such-block"}})
    with pytest.raises(ConfigError, match=r"permissions.test.credentials.block: no AwsCredentials block named "
                                          r"'no-such-block'"):
        session_for(config, "test")


def test_an_empty_block_is_refused_instead_of_falling_back_to_ambient(prefect_server):
    from prefect_aws import AwsCredentials

    name = f"kiln-empty-{uuid.uuid4().hex[:8]}"
    AwsCredentials().save(name)
    config = kiln_config("http://127.0.0.1:1", {"bench": {"block": name}})
    with pytest.raises(ConfigError, match="holds no keys, profile or role"):
        session_for(config, "bench")


def test_ambient_only_when_declared(kiln_log):
    config = kiln_config("http://127.0.0.1:1", {"publish-nightly": {"ambient": True}})
    session = session_for(config, "publish-nightly")
    assert session.region_name == "us-east-1"
    assert "publish-nightly uses the worker's ambient credentials" in kiln_log.text
