"""The CI's OIDC identity is held out of the process environment and exposed to one exchange at a time."""

from __future__ import annotations

import os
import subprocess
import sys

import id as oidc
import pytest

from kiln.core import identity
from tests.helpers.loopback_oidc import loopback_github_oidc_stand_in

NAMES = ("ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL", "PYPI_ID_TOKEN")
PROBE = "import os; print(sorted(k for k in os.environ if 'ID_TOKEN' in k))"


def _child_sees() -> str:
    return subprocess.run([sys.executable, "-I", "-c", PROBE], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


@pytest.mark.parametrize("name, expected", [
    ("ACTIONS_ID_TOKEN_REQUEST_TOKEN", True), ("ACTIONS_ID_TOKEN_REQUEST_URL", True), ("PYPI_ID_TOKEN", True),
    ("GITHUB_TOKEN", False), ("ID_TOKEN_PATH", False), ("PATH", False)])
def test_identity_variables_are_named_by_the_ci_conventions(name, expected):
    assert identity.identity_name(name) is expected


def test_a_kept_identity_leaves_the_environment_children_inherit_and_comes_back_after(monkeypatch):
    for name in NAMES:
        monkeypatch.setenv(name, f"value-of-{name}")
    with identity.kept() as moved:
        assert moved == sorted(NAMES) and identity.held() == sorted(NAMES)
        assert not [name for name in NAMES if name in os.environ]
        assert _child_sees() == "[]"  # git, compilers, installers: nothing of it
        with identity.exposed():
            assert [os.environ[name] for name in NAMES] == [f"value-of-{name}" for name in NAMES]
        assert not [name for name in NAMES if name in os.environ]  # out again after the exchange
    assert [os.environ[name] for name in NAMES] == [f"value-of-{name}" for name in NAMES]
    assert identity.held() == []


def test_the_id_library_finds_a_held_github_identity_only_while_it_is_exposed(monkeypatch):
    # held, a GitHub job looks like one without the id-token permission: id finds no token to ask for
    with loopback_github_oidc_stand_in(monkeypatch, "bearer-never-logged") as token, identity.kept():
        with pytest.raises(oidc.GitHubOidcPermissionCredentialError):
            oidc.detect_credential(audience="kiln-loopback")
        with identity.exposed():
            assert oidc.detect_credential(audience="kiln-loopback") == token
        with pytest.raises(oidc.GitHubOidcPermissionCredentialError):
            oidc.detect_credential(audience="kiln-loopback")


def test_an_exception_in_the_exchange_still_takes_the_identity_out_again(monkeypatch):
    monkeypatch.setenv("PYPI_ID_TOKEN", "gitlab-identity")
    with identity.kept():
        with pytest.raises(RuntimeError), identity.exposed():
            raise RuntimeError("the exchange failed")
        assert "PYPI_ID_TOKEN" not in os.environ
