"""Waiting for a condition, not for a guess of how long a busy machine needs.

Prefect records task-run states and logs asynchronously (the events and log
workers send them after the flow returns), so a test that reads them from the
server polls until what it checks is there, up to a generous deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.5


def until(fetch: Callable[[], T], done: Callable[[T], bool], deadline_s: float = 120.0) -> T:
    """``fetch()`` until ``done`` holds for what it returned, or the deadline; the last value either way.

    The caller asserts on the value, so a timeout fails with the real difference, not "timed out".
    """
    end = time.monotonic() + deadline_s
    value = fetch()
    while not done(value) and time.monotonic() < end:
        time.sleep(POLL_S)
        value = fetch()
    return value
