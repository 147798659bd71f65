"""Trusted Publishing: the worker's OIDC identity exchanged at the index for a short-lived upload token.

PyPI's documented exchange: ``GET <index>/_/oidc/audience`` names the audience
the identity token must carry; the ``id`` library detects the worker's ambient
identity for that audience (GitHub Actions, GitLab CI/CD, Google Cloud —
the identities PyPI trusts; ``id`` reads their environments itself); the
identity token is POSTed as ``{"token": ...}`` to ``<index>/_/oidc/mint-token``,
which answers ``{"token": ...}``: an API token valid for minutes.

The minted token is returned as :class:`~kiln.release.upload.twine.IndexCredentials` to
the one upload that asked for it and is never logged, stored or recorded; the
identity token is dropped after the exchange. Faults are typed here, once: an
endpoint that does not answer, 5xx and 429 are retryable; a refusal (4xx, with
PyPI's ``errors`` body) is :class:`MintRefusedError` naming PyPI's reasons; no
identity is :class:`NoIdentityError`, saying which identities work.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import id as oidc

from kiln.core.errors import ConfigError, PermanentError, ThrottledError, TransientStoreError
from kiln.release.upload.twine import IndexCredentials

log = logging.getLogger(__name__)

IDENTITIES = "GitHub Actions (permissions: id-token: write), GitLab CI/CD (an id_tokens entry for the audience)" \
    " or Google Cloud (the worker's service account)"
TIMEOUT_S = 30.0
MAX_BODY_BYTES = 1 << 20
TOKEN_USERNAME = "__token__"


class NoIdentityError(ConfigError):
    """The worker has no OIDC identity the index could trust; nothing was sent."""


class MintRefusedError(PermanentError):
    """The index refused to mint an upload token for this identity: its reasons say why."""


def oidc_base(upload_url: str, oidc_url: str | None = None) -> str:
    """Where the index serves ``/_/oidc/…``: ``oidc_url`` when given, else the upload URL's scheme and host
    (``https://upload.pypi.org/legacy/`` → ``https://upload.pypi.org``, as twine and PyPI's action do)."""
    parts = urlsplit(oidc_url or upload_url)
    return f"{parts.scheme}://{parts.netloc}"


def _call(url: str, data: bytes | None, timeout: float) -> dict[str, Any]:
    """The JSON object ``url`` answers; typed errors for no answer, 5xx/429 and any other refusal."""
    headers = {"Accept": "application/json"} | ({"Content-Type": "application/json"} if data else {})
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    log.info("%s %s (timeout %.0f s)", request.get_method(), url, timeout)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return _json(url, response.read(MAX_BODY_BYTES))
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            raise ThrottledError(f"{url}: HTTP 429, the index asks to slow down") from exc
        if exc.code >= 500:
            raise TransientStoreError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        raise MintRefusedError(f"{url}: the index refused with HTTP {exc.code}: {_reasons(exc)}") from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, DNS, socket timeout
        raise TransientStoreError(f"{url}: the index did not answer: {getattr(exc, 'reason', exc)}") from exc


def _json(url: str, body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise MintRefusedError(f"{url}: the answer is not JSON") from exc
    if not isinstance(value, dict):
        raise MintRefusedError(f"{url}: the answer is not a JSON object")
    return value


def _reasons(exc: urllib.error.HTTPError) -> str:
    """PyPI's ``{"message": ..., "errors": [{"code", "description"}]}`` as one line; the reason phrase else."""
    try:
        body = json.loads(exc.read(MAX_BODY_BYTES))
        errors = "; ".join(f"{e['code']}: {e['description']}" for e in body["errors"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)
    return f"{body.get('message', exc.reason)}: {errors}"


def audience(base: str, timeout: float = TIMEOUT_S) -> str:
    answer = _call(f"{base}/_/oidc/audience", None, timeout)
    if not isinstance(answer.get("audience"), str):
        raise MintRefusedError(f"{base}/_/oidc/audience: the answer names no audience")
    return str(answer["audience"])


def identity_token(audience_: str) -> str:
    """The worker's OIDC token for ``audience_`` (``id``'s detection); NoIdentityError saying which work."""
    try:
        token = oidc.detect_credential(audience=audience_)
    except oidc.GitHubOidcPermissionCredentialError as exc:
        raise NoIdentityError(f"GitHub Actions gives this job no OIDC token: {exc}; add `permissions: id-token:"
                              " write` to the job") from exc
    except oidc.AmbientCredentialError as exc:  # an identity is there but could not be had
        if "timed out" in str(exc):  # id says so for no answer from the CI's token service: retried
            raise TransientStoreError(f"the worker's OIDC token service did not answer: {exc}") from exc
        raise NoIdentityError(f"the worker's OIDC identity could not be used: {exc}") from exc
    if token is None:
        raise NoIdentityError(f"this worker has no OIDC identity for Trusted Publishing; the identities that work"
                              f" are {IDENTITIES}. Run the upload there, or use an API token (token_block)")
    return token


def check_identity(base: str, timeout: float = TIMEOUT_S) -> None:
    """Refuse early (before a release builds) when the worker has no identity; the token is dropped."""
    identity_token(audience(base, timeout))


def mint_credentials(base: str, timeout: float = TIMEOUT_S) -> IndexCredentials:
    """A short-lived upload token for one upload, from the worker's identity; never logged or stored."""
    token = identity_token(audience(base, timeout))
    answer = _call(f"{base}/_/oidc/mint-token", json.dumps({"token": token}).encode(), timeout)
    minted = answer.get("token")
    if not isinstance(minted, str) or not minted:
        raise MintRefusedError(f"{base}/_/oidc/mint-token: the answer holds no token")
    log.info("minted a short-lived upload token at %s (not shown)", base)
    return IndexCredentials(TOKEN_USERNAME, minted)
