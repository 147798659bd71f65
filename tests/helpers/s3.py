"""moto's S3 server in server mode on loopback: real HTTP, an ephemeral port."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# moto accepts any credentials; set them so boto3 never looks for real ones.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


_PUT_LOCK = threading.Lock()


def make_conditional_puts_atomic() -> None:
    """Serialise moto's PutObject so that its If-None-Match / If-Match check and the write are one step.

    AWS evaluates a conditional write atomically; moto checks the condition and
    then writes without a lock, so under a tight race two conditional PUTs both
    win (about 1 in 30 probes). The race tests exercise Kiln's protocol, not
    moto's: this gives them the S3 semantics they are written against. It
    changes nothing else (every request still goes over HTTP to the server).
    """
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_kiln_atomic", False):
        return
    original = S3Response.put_object

    @functools.wraps(original)
    def put_object(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with _PUT_LOCK:
            return original(self, *args, **kwargs)

    put_object._kiln_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """Yield the URL of a moto server bound to 127.0.0.1 on a port the OS chose."""
    from moto.server import ThreadedMotoServer

    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    make_conditional_puts_atomic()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
