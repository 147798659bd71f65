"""The CI's OIDC identity, held out of the process environment: only the exchange for an upload token sees it.

A CI job that may publish with Trusted Publishing gets an identity through its environment (GitHub Actions'
``ACTIONS_ID_TOKEN_REQUEST_TOKEN``/``_URL``, GitLab's ``<NAME>_ID_TOKEN`` variables). Whoever holds it can mint
an upload token for the project. Guests never see it (:func:`kiln.core.sandbox.guest_env` drops it by name), but
left in ``os.environ`` it would reach every other child Kiln starts for the whole run (git, compilers, pip) and
any code that reads the environment in Kiln's own process. :func:`hold` moves it out, into this module, as the
first thing a command or a flow does; :func:`exposed` puts it back for the one call that needs it (the ``id``
library reads the environment itself) and removes it again, whatever happens. Google Cloud's identity comes
from the metadata server, not the environment: not held here.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_IDENTITY = re.compile(r"^ACTIONS_ID_TOKEN_REQUEST_(TOKEN|URL)$|^[A-Z0-9_]+_ID_TOKEN$")
_held: dict[str, str] = {}
_lock = threading.RLock()


def identity_name(name: str) -> bool:
    """Whether ``name`` is a CI identity variable."""
    return bool(_IDENTITY.match(name))


def hold() -> list[str]:
    """Move every identity variable out of ``os.environ`` into this process's keeping; the names moved (a
    later value of a name replaces the held one: the daemon hands each command its client's environment)."""
    with _lock:
        names = [name for name in os.environ if identity_name(name)]
        for name in names:
            _held[name] = os.environ.pop(name)
        return sorted(names)


def held() -> list[str]:
    """The names of the identity variables held (never their values)."""
    with _lock:
        return sorted(_held)


@contextmanager
def kept() -> Iterator[list[str]]:
    """:func:`hold` for a block (a flow run in a process that runs several): what it moved out of the environment
    goes back when the block ends; the names moved."""
    moved = hold()
    try:
        yield moved
    finally:
        with _lock:
            for name in moved:
                if name in _held:
                    os.environ[name] = _held.pop(name)


@contextmanager
def exposed() -> Iterator[None]:
    """The held identity back in ``os.environ`` for the block (one exchange), and out again after it."""
    with _lock:
        os.environ.update(_held)
        try:
            yield
        finally:
            for name in _held:
                os.environ.pop(name, None)


__all__ = ["exposed", "held", "hold", "identity_name", "kept"]
