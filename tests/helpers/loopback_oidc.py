"""Loopback stand-ins for the two services Trusted Publishing talks to, each named as the stand-in it is.

* :func:`loopback_mint_token_stand_in` plays an index's ``/_/oidc/audience`` and
  ``/_/oidc/mint-token`` (PyPI's documented exchange): it mints ``minted`` for the
  one identity token it trusts, refuses any other with PyPI's error body, or
  answers 503 when told to.
* :func:`loopback_github_oidc_stand_in` plays GitHub Actions' token service
  (``ACTIONS_ID_TOKEN_REQUEST_URL``): for the bearer it was given it answers an
  unsigned JWT naming the requested audience, which the ``id`` library's own
  GitHub detection fetches and checks.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

AUDIENCE = "kiln-loopback"
AMBIENT = ("GITHUB_ACTIONS", "ACTIONS_ID_TOKEN_REQUEST_URL", "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "GITLAB_CI",
           "GOOGLE_SERVICE_ACCOUNT_NAME", "BUILDKITE", "CIRCLECI")
GCP_PRODUCT = Path("/sys/class/dmi/id/product_name")


def jwt(claims: dict[str, object]) -> str:
    """An unsigned JWT (only the index checks signatures; ``id`` reads the audience)."""
    def part(value: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.c2ln"


def without_ambient_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a worker with no OIDC identity: every variable ``id`` detects one by is unset. On a
    Google Cloud machine ``id`` asks the metadata server instead: the test is skipped there, saying so."""
    if GCP_PRODUCT.is_file() and "Google" in GCP_PRODUCT.read_text(errors="replace"):
        pytest.skip("a Google Cloud machine has an ambient identity (its metadata server); id would find it")
    for name in AMBIENT:
        monkeypatch.delenv(name, raising=False)


@dataclass
class MintStandIn:
    url: str  # where /_/oidc/... is served
    minted: str
    trusted: str  # the identity token it mints for
    refuse: bool = False
    unavailable: bool = False
    received: list[str] = field(default_factory=list)  # identity tokens POSTed to mint-token


def _server(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


class _Json(BaseHTTPRequestHandler):
    def answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def loopback_mint_token_stand_in(minted: str, trusted: str) -> Iterator[MintStandIn]:
    """A STAND-IN for an index's token-minting endpoints on 127.0.0.1 (not PyPI)."""
    state = MintStandIn("", minted, trusted)

    class Handler(_Json):
        def do_GET(self) -> None:
            if self.path == "/_/oidc/audience":
                self.answer(200, {"audience": AUDIENCE})
            else:
                self.answer(404, {"message": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.received.append(body.get("token", ""))
            if self.path != "/_/oidc/mint-token" or state.unavailable:
                self.answer(503, {"message": "unavailable"})
            elif state.refuse or body.get("token") != state.trusted:
                self.answer(422, {"message": "Token request failed", "errors": [
                    {"code": "invalid-publisher", "description": "valid token, but no corresponding publisher"}]})
            else:
                self.answer(200, {"success": True, "token": state.minted, "expires": 2_000_000_000})

    server, thread = _server(Handler)
    state.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


@contextmanager
def loopback_github_oidc_stand_in(monkeypatch: pytest.MonkeyPatch, bearer: str) -> Iterator[str]:
    """A STAND-IN for GitHub Actions' OIDC token service on 127.0.0.1, set in this process's environment the way
    a job with ``id-token: write`` has it; yields the identity token it hands out for ``AUDIENCE``."""
    token = jwt({"aud": AUDIENCE, "iss": "https://token.actions.githubusercontent.com", "sub": "repo:kiln/kiln"})

    class Handler(_Json):
        def do_GET(self) -> None:
            audience = parse_qs(urlsplit(self.path).query).get("audience", [""])[0]
            if self.headers.get("Authorization", "").lower() != f"bearer {bearer}":
                self.answer(403, {"message": "bad bearer"})
            else:
                self.answer(200, {"value": token if audience == AUDIENCE else jwt({"aud": audience})})

    without_ambient_identity(monkeypatch)
    server, thread = _server(Handler)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("ACTIONS_ID_TOKEN_REQUEST_URL", f"http://127.0.0.1:{server.server_port}/token")
    monkeypatch.setenv("ACTIONS_ID_TOKEN_REQUEST_TOKEN", bearer)
    try:
        yield token
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
