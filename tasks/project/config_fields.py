"""Field types of ``kiln.toml`` that need more than a Python type: paths, prefixes, URLs, names.

Each is an ``Annotated`` string whose validator raises ``ValueError`` with the
reason; :mod:`kiln.tasks.project.config` turns that into a :class:`ConfigError` that
names the key. Kept apart from the models so the rules read as one table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

from kiln.core.errors import InvalidInputError
from kiln.core.sandbox import credential_name
from kiln.core.steps import prefix_problem
from kiln.core.store import BACKENDS, check_key, scheme_of

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# S3's bucket naming rules (lowercase, 3-63 characters, no '..').
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PLACEHOLDER = re.compile(r"\{[^}]*\}")
# The only placeholder the pipeline fills in: the run directory (see kiln.tasks.releasing).
_PLACEHOLDERS = ("{out}",)


def _local_path(value: str) -> str:
    """A directory on this machine (absolute, or relative to ``kiln.toml``)."""
    if not value or _CONTROL.search(value):
        raise ValueError(f"{value!r} is not a path (empty, or contains a control character)")
    return value


def _project_path(value: str) -> str:
    """A path inside the project, relative to ``kiln.toml``: never absolute, never up and out."""
    if not value or _CONTROL.search(value):
        raise ValueError(f"{value!r} is not a path (empty, or contains a control character)")
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"{value!r} must be a path inside the project, relative to kiln.toml (no leading '/', no '..')"
        )
    return value


def _prefix(value: str) -> str:
    problem = prefix_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _store_prefix(value: str) -> str:
    if not value.strip("/"):
        raise ValueError(f"{value!r} is empty; name a prefix such as 'nightly'")
    return _prefix(value)


def _endpoint(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsing the port is the check: 'http://h:x' raises here
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} must be an http:// or https:// URL with a host, e.g. 'http://127.0.0.1:5000'")
    if parts.query or parts.fragment or _CONTROL.search(value):
        raise ValueError(f"{value!r} must not carry a query, fragment or control characters")
    return value


def _index_url(value: str) -> str:
    """A package index pip and uv can read: an http(s) URL with a host, or a file:// directory."""
    if value.startswith("file://"):
        if not value[len("file://"):] or _CONTROL.search(value) or "#" in value:
            raise ValueError(f"{value!r} must name a directory (file:///abs/simple/) without control characters or '#'")
        return value
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} must be an http(s):// or file:// index URL, e.g. 'https://pypi.org/simple'")
    if parts.fragment or _CONTROL.search(value) or " " in value:
        raise ValueError(f"{value!r} must not carry a fragment, spaces or control characters")
    return value


def _file_url(value: str) -> str:
    path = value[len("file://"):]
    if not path:
        raise ValueError(f"{value!r} names no directory")
    if _CONTROL.search(path):
        raise ValueError(f"{value!r} contains a control character")
    unknown = [p for p in _PLACEHOLDER.findall(path) if p not in _PLACEHOLDERS]
    if unknown:
        raise ValueError(f"{value!r} has unknown placeholders {unknown}; only {list(_PLACEHOLDERS)} is filled in")
    return value


def _s3_url(value: str) -> str:
    bucket, _, prefix = value[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"{value!r} names no bucket")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{value!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, '.', '-')")
    if prefix.strip("/"):
        try:
            check_key(prefix.strip("/"))
        except InvalidInputError as exc:
            raise ValueError(f"{value!r}: the prefix {prefix!r} is not a plain key path: {exc}") from exc
    return value


def _matching(pattern: str, problem: str) -> Callable[[str], str]:
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"{value!r} {problem}")
        return value

    return check


def _pass_env_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(f"pass_env: {value!r} is not an environment variable name")
    if credential_name(value):
        raise ValueError(f"pass_env: {value!r} names a credential, an identity or a Prefect setting, which package"
                         " code never sees (its build and tests run as guests); pass what it needs otherwise")
    return value


# Each store backend's URL check, by scheme: one entry per backend of kiln.core.store.BACKENDS (a test holds
# the two tables to the same schemes), so a new store is its backend and one line here.
URL_CHECKS: dict[str, Callable[[str], str]] = {"file": _file_url, "s3": _s3_url}


def check_store_url(value: str) -> str:
    """A store URL as :func:`kiln.core.store.open_store` takes it (a ``file://`` directory, an
    ``s3://bucket/prefix``), checked by its backend's entry in :data:`URL_CHECKS`."""
    check = URL_CHECKS.get(scheme_of(value))
    if check is None:
        raise ValueError(f"{value!r} must start with one of {', '.join(s + '://' for s in sorted(BACKENDS))}")
    return check(value)


# Variables of Kiln's environment that package code may see, by name (never a credential)
PassEnv = tuple[Annotated[str, AfterValidator(_pass_env_name)], ...]
LocalPath = Annotated[str, AfterValidator(_local_path)]
ProjectPath = Annotated[str, AfterValidator(_project_path)]
Prefix = Annotated[str, AfterValidator(_prefix)]
StorePrefix = Annotated[str, AfterValidator(_store_prefix)]
Endpoint = Annotated[str, AfterValidator(_endpoint)]
IndexUrl = Annotated[str, AfterValidator(_index_url)]
Region = Annotated[str, AfterValidator(_matching(
    # AWS region names ('us-east-1'); S3-compatible services use short words ('auto').
    r"^[a-z0-9][a-z0-9-]*$", "is not a region name such as 'us-east-1'"))]
BlockName = Annotated[str, AfterValidator(_matching(
    r"^[a-z0-9][a-z0-9-]*$", "is not a Prefect block name (lowercase letters, digits and '-')"))]
RoleArn = Annotated[
    str,
    AfterValidator(
        _matching(
            r"^arn:aws[a-z-]*:iam::[0-9]{12}:role/[\w+=,.@/-]+$",
            "is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)",
        )
    ),
]
