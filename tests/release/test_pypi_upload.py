"""Uploads to a real PyPI-compatible server (pypiserver on loopback), through the functions the release flow's
tasks call: the PyPI variant goes up under its public version, pip installs it, a re-run sends nothing, and
other bytes under a published name are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kiln.core.errors import (
    AccessDeniedError,
    AlreadyPublishedError,
    ThrottledError,
    TransientStoreError,
    is_retryable,
)
from kiln.release.upload.pypi_index import JSON_TYPE, read_index
from kiln.release.upload.pypi_release import UploadRequest, prepare_upload
from kiln.release.upload.twine import Endpoint, IndexCredentials, UploadRefusedError, classify, send_file, twine_upload
from tests.helpers.loopback_pypi import PypiServer, pypi_server
from tests.helpers.processes import free_port
from tests.helpers.wheelkit import make_wheel

NOW = datetime.now(UTC)
CREDENTIALS = IndexCredentials("kiln", "pypi-loopback-token")  # pypiserver here accepts any
PIP_TIMEOUT_S = 300


@pytest.fixture
def server(tmp_path) -> Iterator[PypiServer]:
    with pypi_server(tmp_path / "pypiserver") as running:
        yield running


def _endpoint(server: PypiServer) -> Endpoint:
    return Endpoint("loopback", server.url, server.index_url, timeout_s=120)


def _request(server: PypiServer, wheel: Path) -> UploadRequest:
    return UploadRequest(_endpoint(server), "tiny-kernels", "0.3.0", "cpu", (wheel,))


def _pip_install(server: PypiServer, target: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
                           "--disable-pip-version-check", "--index-url", server.index_url, "--target", str(target),
                           "tiny-kernels==0.3.0"], env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def test_the_pypi_variant_goes_up_under_its_public_version_pip_installs_it_and_a_rerun_sends_nothing(
        server, tmp_path):
    wheel = make_wheel(tmp_path / "run", "tiny-kernels", "0.3.0+cpu", module="tinyk", payload="the cpu build")
    prepared = prepare_upload(_request(server, wheel), tmp_path / "public", NOW)
    assert [c.filename for c in prepared.plan.uploads] == ["tiny_kernels-0.3.0-py3-none-any.whl"]
    assert "`tiny_kernels-0.3.0+cpu-py3-none-any.whl` → `tiny_kernels-0.3.0-py3-none-any.whl`" in (
        prepared.plan.to_markdown())
    assert [send_file(path, _endpoint(server), CREDENTIALS) for path in prepared.to_send()] == ["added"]
    assert server.uploads() == 1

    installed = _pip_install(server, tmp_path / "site")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "the cpu build" in (tmp_path / "site" / "tinyk" / "__init__.py").read_text()
    assert (tmp_path / "site" / "tiny_kernels-0.3.0.dist-info").is_dir()

    again = prepare_upload(_request(server, wheel), tmp_path / "public-again", NOW)  # the release run again
    assert [(f.action, f.reason) for f in again.plan.files] == [
        ("skip", "already on the index with the same sha256; nothing sent")]
    assert again.to_send() == []
    assert send_file(again.paths["tiny_kernels-0.3.0-py3-none-any.whl"], _endpoint(server), CREDENTIALS) == "present"
    assert server.uploads() == 1  # nothing was sent the second time


def test_other_bytes_under_a_published_name_are_refused_by_name_and_never_sent(server, tmp_path):
    first = make_wheel(tmp_path / "first", "tiny-kernels", "0.3.0+cpu", payload="first build")
    [path] = prepare_upload(_request(server, first), tmp_path / "public-first", NOW).to_send()
    send_file(path, _endpoint(server), CREDENTIALS)
    other = make_wheel(tmp_path / "other", "tiny-kernels", "0.3.0+cpu", payload="other bytes")
    prepared = prepare_upload(_request(server, other), tmp_path / "public-other", NOW)
    [refused] = prepared.plan.refusals
    assert refused.reason.startswith("tiny_kernels-0.3.0-py3-none-any.whl is already on the index with sha256")
    with pytest.raises(AlreadyPublishedError, match="loopback: tiny_kernels-0.3.0-py3-none-any.whl already holds"):
        send_file(prepared.paths[refused.candidate.filename], _endpoint(server), CREDENTIALS)
    assert server.uploads() == 1


def test_an_index_that_does_not_answer_is_a_retryable_error(tmp_path):
    wheel = make_wheel(tmp_path, "tiny-kernels", "0.3.0")
    port = free_port()  # nothing listens there: the connection is refused
    closed = Endpoint("closed", f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/simple/", timeout_s=60)
    with pytest.raises(TransientStoreError, match="did not answer") as info:
        send_file(wheel, closed, CREDENTIALS)
    assert is_retryable(info.value)


@contextmanager
def fault_injecting_pypi_with_old_upload_times(server: PypiServer, uploaded_at: datetime) -> Iterator[str]:
    """FAULT INJECTION: pypiserver neither dates its files nor applies PyPI's 14-day rule. This loopback
    wrapper answers each project page of the real server as PyPI does (PEP 691 JSON with sizes and upload
    times), dating every file ``uploaded_at``; yields its simple-API URL."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            project = self.path.strip("/").split("/")[-1]
            files = [{"filename": f.filename, "hashes": {"sha256": f.sha256},
                      "size": (server.packages / f.filename).stat().st_size,
                      "upload-time": uploaded_at.isoformat().replace("+00:00", "Z")}
                     for f in read_index(server.index_url, project)]
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": project, "files": files}).encode()
            self.send_response(200)
            self.send_header("Content-Type", JSON_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    wrapper = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=wrapper.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{wrapper.server_port}/simple/"
    finally:
        wrapper.shutdown()
        wrapper.server_close()
        thread.join(timeout=30)


def test_a_new_file_on_a_release_whose_first_file_is_15_days_old_is_refused_with_the_date(server, tmp_path):
    first = make_wheel(tmp_path / "first", "tiny-kernels", "0.3.0", tag="py3-none-any")
    send_file(first, _endpoint(server), CREDENTIALS)
    late = make_wheel(tmp_path / "late", "tiny-kernels", "0.3.0+cpu", tag="py3-none-manylinux_2_28_x86_64")
    now = datetime.now(UTC)
    with fault_injecting_pypi_with_old_upload_times(server, now - timedelta(days=15)) as dated:
        endpoint = Endpoint("loopback", server.url, dated, timeout_s=120)
        prepared = prepare_upload(UploadRequest(endpoint, "tiny-kernels", "0.3.0", "cpu", (late,)), tmp_path / "p",
                                  now)
    [refused] = prepared.plan.refusals
    day = (now - timedelta(days=15)).date().isoformat()
    assert f"release's first file was uploaded on {day} (15 days ago)" in refused.reason
    assert prepared.plan.project_bytes == first.stat().st_size  # PEP 700 sizes count towards the quota
    assert prepared.to_send() == [] and server.uploads() == 1


@pytest.mark.parametrize("output, kind, needle", [
    ("ERROR    HTTPError: 503 Service Unavailable from http://x/\n", TransientStoreError, "HTTP 503"),
    ("ERROR    HTTPError: 429 Too Many Requests from http://x/\n", ThrottledError, "slow down"),
    ("ERROR    HTTPError: 403 Forbidden from http://x/\n         Invalid API Token", AccessDeniedError,
     "the credentials were refused"),
    ("ERROR    HTTPError: 400 Bad Request from http://x/\n         File too large. Limit for project is 100 MB.",
     UploadRefusedError, "File too large. Limit for project is 100 MB."),
    ("requests.exceptions.ConnectionError: ('Connection aborted.', RemoteDisconnected(...))", TransientStoreError,
     "did not answer"),
])
def test_twines_failures_become_typed_errors_retried_only_for_infrastructure(output, kind, needle):
    error = classify("k-1.0-py3-none-any.whl", Endpoint("pypi", "https://u/legacy/", "https://p/simple/"), output)
    assert type(error) is kind and needle in str(error) and "k-1.0-py3-none-any.whl" in str(error)
    assert is_retryable(error) == (kind in (TransientStoreError, ThrottledError))


def test_twine_gets_the_token_in_its_environment_only_and_a_deadline(tmp_path):
    seen: dict[str, object] = {}

    def fault_injecting_runner_that_times_out(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    wheel = make_wheel(tmp_path, "tiny-kernels", "0.3.0")
    endpoint = Endpoint("pypi", "https://u/legacy/", "https://p/simple/", timeout_s=7)
    with pytest.raises(TransientStoreError, match="did not finish within 7 s"):
        twine_upload(wheel, endpoint, CREDENTIALS, runner=fault_injecting_runner_that_times_out,
                     environ={"TWINE_REPOSITORY_URL": "https://elsewhere/", "PATH": "/usr/bin"})
    env = seen["env"]
    assert CREDENTIALS.password not in " ".join(seen["argv"]) and CREDENTIALS.password not in repr(CREDENTIALS)
    assert env["TWINE_PASSWORD"] == CREDENTIALS.password and "TWINE_REPOSITORY_URL" not in env
    assert seen["timeout"] == 7
