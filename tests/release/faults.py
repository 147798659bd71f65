"""Fault injectors for S3 tests (these are the only fakes in the release tests, and they say so).

They hook botocore's event system on a real client talking to moto's real
server, so everything except the injected fault is the genuine code path.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from typing import Any

from botocore.awsrequest import AWSResponse


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def error_response(request: Any, status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected by a test</Message></Error>".encode()
    return AWSResponse(request.url, status, {}, _Raw(body))


def inject_throttling(client: Any, fraction: float, seed: int = 0) -> list[int]:
    """Answer ``fraction`` of requests with 503 SlowDown before they reach the server; returns a hit counter."""
    rng = random.Random(seed)
    hits = [0]

    def maybe_throttle(request: Any, **_: Any) -> AWSResponse | None:
        if rng.random() < fraction:
            hits[0] += 1
            return error_response(request, 503, "SlowDown")
        return None

    client.meta.events.register_first("before-send.s3", maybe_throttle)
    return hits


def kill_after(client: Any, requests: int) -> list[int]:
    """SIGKILL this process just before request number ``requests + 1`` is sent (crash injection)."""
    sent = [0]

    def count(request: Any, **_: Any) -> None:
        if sent[0] >= requests:
            os.kill(os.getpid(), signal.SIGKILL)
        sent[0] += 1

    client.meta.events.register_first("before-send.s3", count)
    return sent
