"""Pinned external artifacts: third-party files the team re-publishes in its index.

Their filename, version, URL and SHA-256 live in a data file (``pins.json``
beside this module by default), never in code. The file is validated against
the schema below when it is read; each download is checked against its pin
and refused on any mismatch, before anything is written where the publisher
would pick it up.

Schema (``schema_version`` 1)::

    {"schema_version": 1,
     "pins": [{"filename": "<PEP 427 wheel name>", "version": "<PEP 440, must match the filename>",
               "url": "https://... | file:///...", "sha256": "<64 lowercase hex>",
               "variants": ["cu130", ...]}]}         # optional; absent = every variant
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from kiln.core.dists import check_sha256, parse_filename
from kiln.core.errors import IntegrityError, InvalidInputError, TransientStoreError
from kiln.core.fsutil import atomic_write_bytes, sha256_bytes

log = logging.getLogger(__name__)

DEFAULT_PINS = Path(__file__).with_name("pins.json")
SCHEMA_VERSION = 1
DOWNLOAD_TIMEOUT_S = 120
_KEYS = {"filename", "version", "url", "sha256", "variants"}


@dataclass(frozen=True)
class Pin:
    filename: str
    version: str
    url: str
    sha256: str
    variants: tuple[str, ...] | None = None  # None: every variant's index


# Any: one entry of pins.json as parsed, checked here
def _pin(entry: Any, where: str) -> Pin:
    if not isinstance(entry, dict):
        raise InvalidInputError(f"{where}: expected an object, got {type(entry).__name__}")
    unknown, missing = set(entry) - _KEYS, (_KEYS - {"variants"}) - set(entry)
    if unknown or missing:
        raise InvalidInputError(f"{where}: unknown keys {sorted(unknown)} / missing keys {sorted(missing)}")
    _, version = parse_filename(entry["filename"])
    try:
        if Version(entry["version"]) != Version(version):
            raise InvalidInputError(f"{where}: version {entry['version']!r} does not match {entry['filename']!r}")
    except (InvalidVersion, TypeError) as exc:
        raise InvalidInputError(f"{where}: version {entry['version']!r} is not PEP 440") from exc
    if not isinstance(entry["url"], str) or not entry["url"].startswith(("https://", "http://", "file:///")):
        raise InvalidInputError(f"{where}: url {entry['url']!r} must be https://, http:// or file:///")
    variants = entry.get("variants")
    if variants is not None and (not isinstance(variants, list) or not all(isinstance(v, str) for v in variants)):
        raise InvalidInputError(f"{where}: variants must be a list of variant names")
    return Pin(entry["filename"], entry["version"], entry["url"], check_sha256(entry["sha256"], f"{where} sha256"),
               None if variants is None else tuple(variants))


def load_pins(path: Path = DEFAULT_PINS) -> list[Pin]:
    """Read and validate a pins file; any problem is an :class:`InvalidInputError` naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"pins file {path}: {exc}") from exc
    if (
        not isinstance(data, dict)
        or data.get("schema_version") != SCHEMA_VERSION
        or set(data) != {"schema_version", "pins"}
    ):
        raise InvalidInputError(f"pins file {path}: expected {{'schema_version': {SCHEMA_VERSION}, 'pins': [...]}}")
    if not isinstance(data["pins"], list):
        raise InvalidInputError(f"pins file {path}: 'pins' must be a list")
    pins = [_pin(entry, f"pins file {path}, pin {i}") for i, entry in enumerate(data["pins"])]
    names = [p.filename for p in pins]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"pins file {path}: a filename is pinned twice")
    return pins


def fetch_pin(pin: Pin, directory: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download ``pin`` into ``directory`` after checking its hash; refuse on mismatch, writing nothing."""
    log.info("downloading pinned %s from %s", pin.filename, pin.url)
    try:
        with urllib.request.urlopen(pin.url, timeout=timeout) as response:
            data = response.read()
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise TransientStoreError(f"downloading pinned {pin.filename} from {pin.url}: {exc}") from exc
    actual = sha256_bytes(data)
    if actual != pin.sha256:
        raise IntegrityError(
            f"pinned {pin.filename} from {pin.url} has sha256 {actual}, the pin says {pin.sha256}; "
            "refusing to publish it"
        )
    path = Path(directory) / pin.filename
    atomic_write_bytes(path, data)
    return path


def fetch_pins(pins: list[Pin], directory: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> list[tuple[str | None, Path]]:
    """Every pin downloaded and verified, as (variant or None for all, path).

    The pairs are what :func:`kiln.release.publish.plan.collect` takes.
    """
    fetched: list[tuple[str | None, Path]] = []
    for pin in pins:
        path = fetch_pin(pin, directory, timeout)
        fetched.extend([(None, path)] if pin.variants is None else [(v, path) for v in pin.variants])
    return fetched
