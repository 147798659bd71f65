"""A moto S3/IAM/STS server on loopback, in its own process, with IAM enforced (the permissions tests' and the release flow's).

Server mode, not the in-process mock: the enforcement switch is global to the
process that serves the requests, and a subprocess keeps it away from every
other test.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest

from kiln.tasks.project.config import KilnConfig, parse_config
from tests.helpers.processes import free_port

log = logging.getLogger("kiln.tests.moto")
REPO = Path(__file__).resolve().parents[2]
BUCKET = "kiln-wheels"
ADMIN = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _wait_up(url: str, proc: subprocess.Popen, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return False


def until_owned(proc: subprocess.Popen, port: int, deadline_s: float = 10) -> bool:
    """Whether ``proc`` is the one listening on ``port`` (it may still be binding when its URL first answers)."""
    from kiln.flows.local.server_identity import owns_port

    end = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < end:
        if owns_port(proc.pid, port):
            return True
        time.sleep(0.2)
    return False


@dataclass
class MotoServer:
    url: str
    proc: subprocess.Popen
    users: dict[str, dict[str, str]] = field(default_factory=dict)

    def admin(self, service: str):
        return boto3.client(service, endpoint_url=self.url, **ADMIN)

    def enforce(self) -> None:
        """Turn IAM enforcement on for every request from now on."""
        # A form content type would hide the body from moto's handler.
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.load(answer)["status"] == "ok"

    def client_as(self, user: str, service: str = "s3"):
        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1", **self.users[user])


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory) -> Iterator[MotoServer]:
    logfile = tmp_path_factory.mktemp("moto") / "server.log"
    for _attempt in range(3):  # another process may take the free port first
        port = free_port()
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        log.info("starting %s", " ".join(command))
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        # Ours, not another xdist worker's moto that took the port first: it answers /moto-api/ as well, and its
        # tests would reset or enforce the IAM state this module's fixtures made (InvalidClientTokenId).
        if _wait_up(url, proc, deadline_s=30) and until_owned(proc, port):
            break
        proc.kill()
        proc.wait(timeout=10)
    else:
        pytest.fail(f"moto server did not start; see {logfile}")
    try:
        yield MotoServer(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def kiln_config(endpoint: str, credentials: dict[str, dict]) -> KilnConfig:
    """The repo's project with an S3 default target on the moto server.

    Each step's credentials: ``credentials[step]``, else the block ``kiln-<step>`` (as the repo's
    kiln.toml names them): a step that talks to S3 must name a source (see test_explicit_credentials).
    """
    data = {
        "project": {"package": "kiln_kernels", "distribution": "kiln-kernels", "version": "0.1.0",
                    "source": "kernels/kiln_kernels", "registry": "kiln_kernels.registry:registry"},
        "variants": [{"name": "cpu", "backend": "cpu"}],
        "publish": {"default_target": "s3", "channels": {"nightly": "nightly", "release": "release"},
                    "targets": {"s3": {"url": f"s3://{BUCKET}/simple", "region": "us-east-1", "endpoint": endpoint}}},
        "permissions": {
            "build": {"read": ["artifacts/"], "write": ["artifacts/"]},
            "test": {"read": ["artifacts/"], "write": ["artifacts/"]},
            "bench": {"read": ["artifacts/", "bench-history/"], "write": ["bench-history/"]},
            "publish-nightly": {"read": ["nightly/"], "write": ["nightly/"]},
            "publish-release": {"read": ["release/"], "write": ["release/"]},
            "prune-nightly": {"read": ["nightly/"], "write": ["nightly/"]},
        },
    }
    for step, permission in data["permissions"].items():
        permission["credentials"] = credentials.get(step, {"block": f"kiln-{step}"})
    return parse_config(data, REPO)


@pytest.fixture
def kiln_log(caplog):
    """caplog for the ``kiln`` loggers, which Prefect may stop from propagating."""
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="kiln")
    yield caplog
    logger.removeHandler(caplog.handler)
