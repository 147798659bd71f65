"""Trusted Publishing's exchange (kiln.release.upload.trusted_publishing) against loopback stand-ins: the identity
comes from the ``id`` library's own GitHub Actions detection (its token service a loopback stand-in) or its
GitLab detection (an environment variable); the minting endpoint is a loopback stand-in for PyPI's."""

from __future__ import annotations

import logging

import pytest

from kiln.core.errors import ThrottledError, TransientStoreError, is_retryable
from kiln.release.upload.trusted_publishing import (
    MintRefusedError,
    NoIdentityError,
    check_identity,
    mint_credentials,
    oidc_base,
)
from kiln.release.upload.twine import IndexCredentials, twine_env
from tests.helpers.loopback_oidc import (
    AUDIENCE,
    jwt,
    loopback_github_oidc_stand_in,
    loopback_mint_token_stand_in,
    without_ambient_identity,
)
from tests.helpers.processes import free_port

MINTED = "pypi-minted-by-the-loopback-stand-in"


def test_a_github_identity_is_exchanged_for_the_minted_token_which_no_log_shows(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with loopback_github_oidc_stand_in(monkeypatch, bearer="actions-bearer") as identity, \
            loopback_mint_token_stand_in(MINTED, trusted=identity) as mint:
        credentials = mint_credentials(mint.url)
    assert (credentials.username, credentials.password) == ("__token__", MINTED)
    assert mint.received == [identity]  # the identity the id library fetched for the index's audience
    assert MINTED not in repr(credentials)
    assert MINTED not in caplog.text and identity not in caplog.text and "actions-bearer" not in caplog.text


def test_a_gitlab_identity_from_its_environment_variable_is_exchanged(monkeypatch):
    without_ambient_identity(monkeypatch)
    identity = jwt({"aud": AUDIENCE, "iss": "https://gitlab.com"})
    monkeypatch.setenv("GITLAB_CI", "true")
    monkeypatch.setenv("KILN_LOOPBACK_ID_TOKEN", identity)  # id's name for the audience's variable
    with loopback_mint_token_stand_in(MINTED, trusted=identity) as mint:
        assert mint_credentials(mint.url).password == MINTED


def test_no_identity_is_refused_naming_the_identities_that_work(monkeypatch):
    without_ambient_identity(monkeypatch)
    with loopback_mint_token_stand_in(MINTED, trusted="none") as mint:
        with pytest.raises(NoIdentityError) as info:
            check_identity(mint.url)
        assert mint.received == []  # nothing was asked to mint
    message = str(info.value)
    assert "no OIDC identity" in message and "token_block" in message
    assert all(name in message for name in ("GitHub Actions", "GitLab", "Google Cloud"))
    assert not is_retryable(info.value)


def test_a_refusal_is_permanent_and_names_pypis_reason(monkeypatch):
    with loopback_github_oidc_stand_in(monkeypatch, bearer="b") as identity, \
            loopback_mint_token_stand_in(MINTED, trusted=identity) as mint:
        mint.refuse = True
        with pytest.raises(MintRefusedError) as info:
            mint_credentials(mint.url)
    assert "HTTP 422" in str(info.value)
    assert "invalid-publisher: valid token, but no corresponding publisher" in str(info.value)
    assert not is_retryable(info.value)


def test_a_minting_endpoint_that_does_not_answer_is_retryable(monkeypatch):
    with loopback_github_oidc_stand_in(monkeypatch, bearer="b") as identity, \
            loopback_mint_token_stand_in(MINTED, trusted=identity) as mint:
        mint.unavailable = True
        with pytest.raises(TransientStoreError, match="HTTP 503") as unavailable:
            mint_credentials(mint.url)
        closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        with pytest.raises(TransientStoreError, match="did not answer") as silent:
            mint_credentials(closed)
    assert is_retryable(unavailable.value) and is_retryable(silent.value)
    assert not isinstance(silent.value, ThrottledError)


@pytest.mark.parametrize("upload_url, oidc_url, base", [
    ("https://upload.pypi.org/legacy/", None, "https://upload.pypi.org"),
    ("https://test.pypi.org/legacy/", None, "https://test.pypi.org"),
    ("https://upload.example/legacy/", "https://mint.example/x/", "https://mint.example"),
])
def test_the_oidc_endpoints_are_on_the_upload_host_unless_named(upload_url, oidc_url, base):
    assert oidc_base(upload_url, oidc_url) == base


def test_twine_gets_the_minted_token_and_none_of_the_workers_identity():
    env = twine_env(IndexCredentials("__token__", MINTED), {
        "PATH": "/usr/bin", "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "bearer", "ACTIONS_ID_TOKEN_REQUEST_URL": "http://x/",
        "PYPI_ID_TOKEN": "gitlab-identity", "TWINE_PASSWORD": "ambient"})
    assert env["TWINE_PASSWORD"] == MINTED and env["TWINE_USERNAME"] == "__token__" and env["PATH"] == "/usr/bin"
    assert not {"ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL", "PYPI_ID_TOKEN"} & set(env)
