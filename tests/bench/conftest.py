from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "benchproj"


@pytest.fixture
def benchproj(tmp_path: Path) -> Path:
    """A fresh copy of the torch-only bench project; returns its kiln.toml."""
    root = tmp_path / "benchproj"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root / "kiln.toml"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback (real HTTP, ephemeral port), for history in S3."""
    import os

    from moto.server import ThreadedMotoServer

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
