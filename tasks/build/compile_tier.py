"""Where the compile cache's shared tier lives: the unit cache's tier in the artifact store, ``compile/`` below it.

``[build.cache] remote = "artifacts"`` gives both caches a shared tier under the same prefix, so one rule of the
generated access policies covers both (:mod:`kiln.release.stores.policies`: only the build step writes
``<prefix>/``; other steps read it or nothing). The compile cache is ccache's remote storage
(:class:`~kiln.tasks.build.compile_cache.SharedTier`):

- a ``file://`` store: ccache's ``file:`` backend on the store's own folder ``<root>/<prefix>/compile``, which a
  sandboxed compile is granted to write (read only, with ``read_only``), and nothing else of the store;
- a remote store (``s3://``): Kiln's storage helper (:mod:`kiln.tasks.build.ccache_bridge`) on a Unix socket,
  run by the build step outside the sandbox with the store it opened under the build role's credentials.

A folder the worker cannot use, or a bridge that cannot start, is one warning and a worker-local compile cache.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

from kiln.core.objects import Store
from kiln.core.store import LocalStore
from kiln.tasks.build.ccache_bridge import REQUEST_TIMEOUT_S, Bridge
from kiln.tasks.build.compile_cache import SharedTier
from kiln.tasks.project.config_build import BuildCacheSettings

_log = logging.getLogger(__name__)

COMPILE_PREFIX = "compile"  # below [build.cache] prefix, beside the unit cache's objects/ and entries/
# ccache's own deadlines for the bridge: a request that takes longer is a remote storage timeout, and the
# compile goes on (ccache counts it; the translation unit compiles or hits locally).
BRIDGE_PROPERTIES = (f"request-timeout={int(REQUEST_TIMEOUT_S)}s", "data-timeout=10s")


def shared_tier(settings: BuildCacheSettings, store: Store | None) -> SharedTier | None:
    """The compile cache's shared tier that ``[build.cache]`` names in the build step's ``store``; None for a
    worker-local compile cache."""
    if settings.remote == "none" or store is None:
        return None
    where, read_only = f"{settings.prefix.strip('/')}/{COMPILE_PREFIX}", settings.read_only
    if isinstance(store, LocalStore):
        return _folder_tier(store.root / where, read_only, settings.reshare)
    try:
        bridge = Bridge(store, where, read_only).start()
    except OSError as exc:
        _log.warning("compile cache: could not serve the shared tier to ccache (%s); compiles use the local cache "
                     "only", exc)
        return None
    tier = SharedTier(f"crsh:{bridge.socket_path}", read_only, bridge.socket_path.parent, BRIDGE_PROPERTIES,
                      settings.reshare)
    weakref.finalize(tier, bridge.close)  # the bridge ends with the build that holds this tier
    return tier


def _folder_tier(folder: Path, read_only: bool, reshare: bool = False) -> SharedTier | None:
    """ccache's ``file:`` backend on ``folder``; None (with one warning) when this worker cannot use it."""
    try:
        if not read_only:
            folder.mkdir(parents=True, exist_ok=True)
        usable = folder.is_dir() and os.access(folder, os.R_OK | os.X_OK | (0 if read_only else os.W_OK))
    except OSError as exc:
        usable, why = False, str(exc)
    else:
        why = "missing" if not folder.is_dir() else "not accessible to this worker"
    if not usable:
        if read_only and not folder.exists():
            _log.info("compile cache: the shared tier %s holds nothing yet; compiles use the local cache", folder)
        else:
            _log.warning("compile cache: the shared tier %s is %s; compiles use the local cache only", folder, why)
        return None
    # ccache reads its remote storage setting as URL-encoded, space-separated words
    url = str(folder).replace("%", "%25").replace(" ", "%20").replace("|", "%7C").replace("\t", "%09")
    return SharedTier(f"file:{url}", read_only, folder, reshare=reshare)
