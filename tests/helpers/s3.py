"""moto's S3 server in server mode on loopback: real HTTP, an ephemeral port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# moto accepts any credentials; set them so boto3 never looks for real ones.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """Yield the URL of a moto server bound to 127.0.0.1 on a port the OS chose."""
    from moto.server import ThreadedMotoServer

    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
