"""The one compare-and-swap retry policy: bounded attempts, jittered exponential backoff.

Every rewrite of a shared object (index pages, run-record objects, a restore
after a rollback) re-reads, recomputes and swaps on the ETag it read; a lost
race (:class:`ConflictError`) re-runs the whole attempt. All of them use the
loop here, so they share one bound and one backoff.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from kiln.core.errors import ConflictError
from kiln.core.objects import Store

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 8  # a publish races at most a handful of concurrent publishers
BACKOFF_BASE = (0.01, 0.05)  # seconds of jitter before the first retry; doubles each time

T = TypeVar("T")


def backoff(attempt: int) -> float:
    """Seconds to wait after losing the ``attempt``-th race (0-based)."""
    return float(random.uniform(*BACKOFF_BASE) * 2**attempt)


def until_swapped(what: str, attempt: Callable[[], T], sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``attempt`` (read, recompute, swap) until no :class:`ConflictError`; at most CAS_ATTEMPTS times."""
    for n in range(CAS_ATTEMPTS):
        try:
            return attempt()
        except ConflictError:
            log.info("lost a race on %s (attempt %d of %d); re-reading", what, n + 1, CAS_ATTEMPTS)
            if n + 1 < CAS_ATTEMPTS:
                sleep(backoff(n))
    raise ConflictError(f"{what}: still changing after {CAS_ATTEMPTS} attempts; retry")


def put_until_swapped(store: Store, key: str, data: bytes, content_type: str, cache_control: str,
                      sleep: Callable[[float], None] = time.sleep) -> bool:
    """Make ``key`` hold exactly ``data``; False when it already did (nothing written)."""

    def attempt() -> bool:
        current = store.get_page(key)
        if current is not None and current[0] == data:
            return False
        store.put_page(key, data, content_type, cache_control, None if current is None else current[1])
        return True

    return until_swapped(f"{store.url}/{key}", attempt, sleep)
