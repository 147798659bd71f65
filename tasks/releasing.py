"""The release's own decisions: version checks, the publish gate, page rollback.

Plain functions (no Prefect): :mod:`flows.release` orders them. The store is
passed in, so tests hand in a local directory or an S3 server on loopback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from release.errors import ConfigError, ConflictError, InvalidInputError, KilnError, RegressionError
from release.fsutil import atomic_write_bytes, atomic_write_text
from release.index import HTML_PAGE, HTML_TYPE, JSON_PAGE, JSON_TYPE, parse_project_json
from release.publish import PAGE_CACHE
from release.store import Store, open_store

log = logging.getLogger("kiln.release")

PAGE_NAMES = (HTML_PAGE, JSON_PAGE)

CAS_ATTEMPTS = 5


class ReleaseGateError(KilnError):
    """A stage before publishing failed; the release stops with nothing published."""


def channel_prefix(config: Any, channel: str) -> str:
    """The store prefix of ``channel``; an unknown channel is a clear error."""
    channels = dict(config.publish.channels)
    if channel not in channels:
        raise ConfigError(f"unknown channel {channel!r}; kiln.toml [publish] channels are {sorted(channels)}")
    return channels[channel].strip("/")


def open_target(config: Any, out: str, session: Any = None, target: str | None = None) -> Store:
    """The publish target's store (``{out}`` in a ``file://`` URL is the run directory)."""
    name = target or config.publish.default_target
    spec = config.publish.targets[name]
    url = spec.url.replace("{out}", str(Path(out).resolve()))
    return open_store(url, root=config.root, region=spec.region, endpoint=spec.endpoint,
                      expected_owner=spec.expected_owner, session=session)


def _project_pages(store: Store, prefix: str, distribution: str) -> list[str]:
    name = canonicalize_name(distribution)
    return [k for k in store.list(f"{prefix}/") if k.endswith(f"/{name}/{JSON_PAGE}")]


def published_versions(store: Store, prefix: str, distribution: str) -> list[Version]:
    """Public versions of ``distribution`` on every index under ``prefix`` (all variants)."""
    versions: set[Version] = set()
    for key in _project_pages(store, prefix, distribution):
        data = store.get(key)
        if data is None:  # listed, then gone: a page is never deleted, so only a race with a test
            continue
        for dist in parse_project_json(data, key):
            versions.add(Version(Version(dist.version).public))
    return sorted(versions)


def check_version(version: str, channel: str, published: Iterable[Version]) -> str:
    """The normalised version, or :class:`InvalidInputError` saying why it cannot be released."""
    try:
        wanted = Version(version)
    except InvalidVersion:
        raise InvalidInputError(f"version {version!r} is not a PEP 440 version (e.g. 1.2.0, 1.2.0rc1)") from None
    if wanted.local:
        raise InvalidInputError(f"version {version!r} has a local part; each variant adds its own (+cu130)")
    published = sorted(published)
    if wanted in published:
        raise InvalidInputError(f"version {wanted} is already published on the {channel} channel; "
                                f"published versions are immutable — choose a new version")
    if published and wanted < published[-1]:
        raise InvalidInputError(f"version {wanted} is lower than the last {channel} release {published[-1]}; "
                                f"a release must be greater than every published version")
    return str(wanted)


def check_gate(stages: Mapping[str, tuple[str, str]], allow_regressions: str | None) -> str:
    """Decide whether the release may go on to approval and publishing.

    ``stages`` maps a stage name to its final state's (type, message). A failed
    build or test always stops the release; a failed bench stops it unless
    ``allow_regressions`` gives the reason, which the returned summary records.
    """
    failed = {name: message for name, (kind, message) in stages.items() if kind != "COMPLETED"}
    blocking = {n: m for n, m in failed.items() if n != "bench" or not allow_regressions}
    if blocking:
        detail = "; ".join(f"{n}: {m or 'failed'}" for n, m in sorted(blocking.items()))
        error = RegressionError if set(blocking) == {"bench"} else ReleaseGateError
        raise error(f"release stopped before publishing — {detail}")
    if "bench" in failed:
        return f"published despite benchmark regressions, because: {allow_regressions} ({failed['bench']})"
    return "build, tests and benchmarks passed"


def snapshot_pages(store: Store, prefix: str, directory: Path) -> list[str]:
    """Copy every index page under ``prefix`` to ``directory`` before publishing.

    On disk rather than in memory so that a rollback can still run after the
    publishing process crashed. Returns the keys saved.
    """
    keys = [k for k in store.list(f"{prefix}/") if k.rsplit("/", 1)[-1] in PAGE_NAMES]
    for key in keys:
        data = store.get(key)
        if data is not None:
            atomic_write_bytes(directory / "pages" / key, data)
    atomic_write_text(directory / "pages.json", json.dumps({"prefix": prefix, "keys": keys}, indent=2) + "\n")
    log.info("saved %d index pages under %s/ to %s", len(keys), prefix, directory)
    return keys


def _restore_one(store: Store, key: str, old: bytes) -> bool:
    content_type = HTML_TYPE if key.endswith(HTML_PAGE) else JSON_TYPE
    for _attempt in range(CAS_ATTEMPTS):  # bounded: a concurrent publisher is refused by the deployment limit
        current = store.get_page(key)
        if current is not None and current[0] == old:
            return False
        try:
            store.put_page(key, old, content_type, PAGE_CACHE, current[1] if current else None)
            return True
        except ConflictError:
            continue
    raise ConflictError(f"could not restore {key}: it kept changing ({CAS_ATTEMPTS} attempts)")


def restore_pages(store: Store, directory: Path) -> dict[str, list[str]]:
    """Put every saved page back byte for byte; report what changed and what is new.

    Project pages first and root pages last, the publishing order. Pages that
    did not exist before stay (nothing Kiln does deletes), but the restored
    root pages no longer link to them, and every wheel they name still exists.
    """
    saved = json.loads((directory / "pages.json").read_text())
    keys: list[str] = saved["keys"]
    ordered = sorted(keys, key=lambda k: (k.count("/"), k), reverse=True)
    restored = [k for k in ordered if _restore_one(store, k, (directory / "pages" / k).read_bytes())]
    now = [k for k in store.list(f"{saved['prefix']}/") if k.rsplit("/", 1)[-1] in PAGE_NAMES]
    new = sorted(set(now) - set(keys))
    log.warning("rolled back %d index pages under %s/ (new pages left unlinked: %d)",
                len(restored), saved["prefix"], len(new))
    return {"restored": sorted(restored), "new": new}
