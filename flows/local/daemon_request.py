"""What a ``kiln`` client asks Kiln's daemon to run (:mod:`kiln.flows.local.daemon`), checked at the daemon's edge.

A request is one JSON object (``SCM_RIGHTS`` carries its stdin, stdout and
stderr beside it): the daemon's key, argv, working directory, environment,
umask and resource limits. The daemon parses it here, once, into a frozen
:class:`Request`; anything else (garbage bytes, truncated JSON, a field of
the wrong type) is a :class:`BadRequest` it refuses, and it keeps serving.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The resource limits a child takes from its client (RLIMIT_OFILE is another name of RLIMIT_NOFILE).
RLIMITS = tuple(name for name in (
    "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE",
    "RLIMIT_NICE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_RSS", "RLIMIT_RTPRIO", "RLIMIT_RTTIME",
    "RLIMIT_SIGPENDING", "RLIMIT_STACK",
) if hasattr(resource, name))


class BadRequest(ValueError):
    """A daemon got a request it cannot run: not JSON, or a field missing or of the wrong type."""


@dataclass(frozen=True)
class Request:
    """What a client asks its daemon to run, checked field by field (:func:`parse_request`)."""

    key: str
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    umask: int
    rlimits: Mapping[str, tuple[int, int]]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "argv": list(self.argv), "cwd": self.cwd, "env": dict(self.env),
                "umask": self.umask, "rlimits": {k: list(v) for k, v in self.rlimits.items()}}


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise BadRequest(f"{what} is not a string (without NUL bytes): {value!r:.80}")
    return value


def _limit(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not resource.RLIM_INFINITY <= value < 1 << 63:
        raise BadRequest(f"{what} is not a resource limit: {value!r:.80}")
    return value


def _env(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise BadRequest("env is not a JSON object")
    env = {_text(k, "an environment name"): _text(v, f"the environment's {k!r:.40}") for k, v in value.items()}
    if any(not k or "=" in k for k in env):
        raise BadRequest("an environment name is empty or contains '='")
    return env


def _rlimits(value: object) -> dict[str, tuple[int, int]]:
    if not isinstance(value, dict) or set(value) - set(RLIMITS):
        raise BadRequest(f"rlimits is not an object of {', '.join(RLIMITS)}")
    limits = {}
    for name, pair in value.items():
        if not isinstance(pair, list) or len(pair) != 2:
            raise BadRequest(f"rlimits[{name!r}] is not [soft, hard]")
        limits[name] = (_limit(pair[0], f"the soft {name}"), _limit(pair[1], f"the hard {name}"))
    return limits


def parse_request(data: bytes) -> Request:
    """A client's request, every field checked; :class:`BadRequest` says which is wrong."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"not JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict):
        raise BadRequest("not a JSON object")
    missing = sorted({"key", "argv", "cwd", "env", "umask", "rlimits"} - set(raw))
    if missing:
        raise BadRequest(f"no {', '.join(missing)}")
    argv, umask = raw["argv"], raw["umask"]
    if not isinstance(argv, list) or not argv:
        raise BadRequest("argv is not a non-empty list")
    if isinstance(umask, bool) or not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise BadRequest(f"umask is not a file mode mask: {umask!r:.80}")
    cwd = _text(raw["cwd"], "cwd")
    if not os.path.isabs(cwd):
        raise BadRequest(f"cwd is not an absolute path: {cwd!r:.80}")
    return Request(key=_text(raw["key"], "key"), argv=tuple(_text(a, "an argument") for a in argv), cwd=cwd,
                   env=_env(raw["env"]), umask=umask, rlimits=_rlimits(raw["rlimits"]))


def caller_limits() -> tuple[int, dict[str, tuple[int, int]]]:
    """This process's umask and resource limits: its command's child in the daemon takes them."""
    mask = os.umask(0o077)  # reading the umask sets it: the stricter one, for the instant between
    os.umask(mask)
    return mask, {name: resource.getrlimit(getattr(resource, name)) for name in RLIMITS}
