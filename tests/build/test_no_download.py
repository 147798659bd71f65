"""A pep517 build reaches no download host: a bdist_wheel that first fetches a prebuilt wheel (flash-attention's
pattern, the prebuilt fixture: setup.py only) never connects, so it builds from source or fails; never publishes
bytes Kiln did not build."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.build.guest_install import REFUSING_PROXY, without_network
from tests.helpers.projects import copy_project


class _Counting(BaseHTTPRequestHandler):
    """A download host: serves its wheel (404 without one) and counts each request."""

    requests: list[str] = []
    wheel: bytes = b""

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        if not self.wheel:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.wheel)))
        self.end_headers()
        self.wfile.write(self.wheel)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def prebuilt_wheel(tmp_path) -> bytes:
    """Someone else's wheel of the package: a library no build of this project compiled."""
    from tests.helpers.wheelkit import make_wheel

    return make_wheel(tmp_path / "elsewhere", "prebuilt_ops", "1.0.0", module="pbops",
                      files={"pbops/_native.so": b"\x7fELF not built here"}).read_bytes()


def _serve(wheel: bytes) -> Iterator[tuple[str, list[str]]]:
    requests: list[str] = []
    handler = type("Handler", (_Counting,), {"requests": requests, "wheel": wheel})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/prebuilt_ops.whl", requests
    finally:
        server.shutdown()
        thread.join(timeout=10)


@pytest.fixture
def download_host() -> Iterator[tuple[str, list[str]]]:
    yield from _serve(b"")


def test_a_builds_environment_routes_every_fetch_to_a_refusing_proxy_unless_build_env_says_otherwise():
    env = without_network({"PATH": "/bin", "no_proxy": "*", "NO_PROXY": "example.org", "https_proxy": "http://p:3"})
    assert "no_proxy" not in env and "NO_PROXY" not in env and env["PATH"] == "/bin"
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        assert env[name] == REFUSING_PROXY


def test_a_prebuilt_wheel_download_in_the_build_never_reaches_its_host_and_the_wheel_is_built_here(
        prefect_server, tmp_path, monkeypatch, download_host):
    from kiln.flows.build import build_flow

    url, requests = download_host
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the host is up: it answers us
    with pytest.raises(urllib.error.HTTPError):
        direct.open(url, timeout=30)
    assert requests == ["/prebuilt_ops.whl"]
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")  # even a machine exempting loopback from its proxy
    config = copy_project("prebuilt", tmp_path)
    # the build is told the URL and exempts the host from the refusing proxy: only the sandbox stands between
    env = f'build_env = {{ PREBUILT_OPS_WHEEL_URL = "{url}", no_proxy = "127.0.0.1" }}\n'
    config.write_text(config.read_text().replace('backend = "cpu"\n', f'backend = "cpu"\n{env}'))
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.1.dev20261206", return_state=True)
    assert state.is_completed(), state.message
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    [wheel] = [run.root / a.path for a in run.artifacts_of("wheel")]
    with zipfile.ZipFile(wheel) as archive:
        assert b"def double" in archive.read("pbops/__init__.py")  # built from its source, here
    assert requests == ["/prebuilt_ops.whl"]  # the build's download attempt never arrived


def test_a_wheel_holding_a_library_the_build_did_not_compile_fails_its_unit_naming_it(
        prefect_server, tmp_path, prebuilt_wheel):
    """A prebuilt wheel that reaches the build anyway (here shipped in the sources, as a vendored cache would
    be; builds have no network): the unit still refuses to publish what it did not build."""
    from kiln.flows.build import build_flow

    config = copy_project("prebuilt", tmp_path)
    (config.parent / "prebuilt_cache.whl").write_bytes(prebuilt_wheel)
    # a file: URL relative to setup.py's folder, the copy of the sources the build runs in
    env = 'build_env = { PREBUILT_OPS_WHEEL_URL = "file:prebuilt_cache.whl" }\n'
    config.write_text(config.read_text().replace('backend = "cpu"\n', f'backend = "cpu"\n{env}'))
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.1.dev20261206", return_state=True)
    assert state.is_failed()
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    [unit] = [u for u in run.units if u.id.endswith("/pep517")]
    assert unit.state == "failed"
    assert "put libraries in its wheel that it did not compile: ['pbops/_native.so']" in unit.message, unit.message
    assert run.artifacts_of("wheel") == []
