"""Benchmark history in the artifact store: one immutable results file per run.

Keys are ``<bench.history>/<UTC timestamp>-<run id>.json``; the timestamp is
fixed-width, so the store's sorted listing is chronological and ``last``
never needs to read more than the files it skips. Results are written
create-only (same bytes again is success), so a retried task cannot rewrite
history.

``last`` is the newest stored *nightly* result of the same variant and
decision metric: an ad-hoc ``kiln bench`` on a laptop must not become the
baseline the next release is judged against.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from release.errors import InvalidInputError, KilnError
from release.store import Store, open_store
from tasks.benchresults import BenchResults, load_results, parse_results
from tasks.config import KilnConfig

_log = logging.getLogger("kiln.bench")

CONTENT_TYPE = "application/json"
CACHE_CONTROL = "public, max-age=31536000, immutable"
HISTORY_LIMIT = 30  # runs drawn in the trend plot


def history_store(config: KilnConfig, session: Any = None) -> Store:
    """The artifact store ``[artifacts]`` names; ``session`` holds the bench step's credentials."""
    target = config.artifacts
    return open_store(target.url, root=config.root, region=target.region, endpoint=target.endpoint,
                      expected_owner=target.expected_owner, session=session)


def _prefix(config: KilnConfig) -> str:
    return config.bench.history.strip("/") + "/"


def history_key(config: KilnConfig, results: BenchResults) -> str:
    stamp = results.created.replace("-", "").replace(":", "")  # 2026-11-29T19:02:27Z -> 20261129T190227Z
    run_id = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in results.run_id)
    return f"{_prefix(config)}{stamp}-{run_id}.json"


def store_results(store: Store, config: KilnConfig, results: BenchResults) -> str:
    key = history_key(config, results)
    _log.info("storing benchmark results as %s/%s", store.url, key)
    store.put_immutable(key, results.to_json().encode("utf-8"), CONTENT_TYPE, CACHE_CONTROL)
    return key


def _read(store: Store, key: str) -> BenchResults | None:
    """A stored result, or None (with a warning) when it vanished or does not validate."""
    data = store.get(key)
    if data is None:
        return None
    try:
        return parse_results(data, f"{store.url}/{key}")
    except InvalidInputError as exc:
        _log.warning("skipping unreadable history entry: %s", exc)
        return None


def load_history(
    store: Store, config: KilnConfig, *, variant: str, metric: str, limit: int = HISTORY_LIMIT
) -> list[BenchResults]:
    """Up to ``limit`` stored results of ``variant``/``metric``, oldest first."""
    found: list[BenchResults] = []
    for key in reversed(store.list(_prefix(config))):
        if len(found) >= limit:
            break
        results = _read(store, key)
        if results is not None and results.variant == variant and results.decision_metric == metric:
            found.append(results)
    return found[::-1]


def last_nightly(store: Store, config: KilnConfig, *, variant: str, metric: str,
                 exclude_run: str = "") -> BenchResults | None:
    """The newest stored nightly result of ``variant``/``metric``, or None when there is none yet."""
    for key in reversed(store.list(_prefix(config))):
        results = _read(store, key)
        if (results is not None and results.flow == "nightly" and results.run_id != exclude_run
                and results.variant == variant and results.decision_metric == metric):
            _log.info("baseline 'last': %s/%s (run %s)", store.url, key, results.run_id)
            return results
    return None


def resolve_baseline(compare: str | None, current: BenchResults, config: KilnConfig,
                     store: Store | None) -> BenchResults | None:
    """``None`` → no comparison; ``"last"`` → the previous nightly (None on the first night); else a file."""
    if compare is None:
        return None
    if compare == "last":
        if store is None:
            raise InvalidInputError("--compare last needs the artifact store, which could not be opened")
        found = last_nightly(store, config, variant=current.variant, metric=current.decision_metric,
                             exclude_run=current.run_id)
        if found is None:
            _log.warning("no stored nightly result of variant %s (%s) under %s/%s; nothing to compare against",
                         current.variant, current.decision_metric, store.url, _prefix(config))
        return found
    return load_results(compare)


def check_compare(compare: str | None) -> None:
    """Validate ``--compare`` before measuring: ``None``, ``"last"`` or a readable results file."""
    if compare is not None and compare != "last":
        load_results(compare)


def open_history(config: KilnConfig, session_factory: Callable[[], Any] | None = None) -> Store | None:
    """The history store, or None (logged) when it cannot be opened.

    ``session_factory`` gives the bench step's boto3 session; it is called only
    for an ``s3://`` store, so a local run needs no credentials. Losing history
    is a warning, not a failed benchmark; ``--compare last`` then fails clearly.
    """
    try:
        session = session_factory() if config.artifacts.kind == "s3" and session_factory else None
        return history_store(config, session)
    except KilnError as exc:
        _log.warning("benchmark history unavailable: %s", exc)
        return None


def store_if(enabled: bool, store: Store | None, config: KilnConfig, results: BenchResults) -> str:
    """Store ``results`` when asked to and a store is open; say which happened."""
    if not enabled:
        return "history not stored (store_history is off)"
    if store is None:
        return "history not stored (the artifact store could not be opened)"
    return f"stored as {store_results(store, config, results)}"


def history_with(store: Store | None, config: KilnConfig, current: BenchResults) -> list[BenchResults]:
    """Stored history of the current variant/metric (oldest first) with ``current`` last."""
    stored = [] if store is None else load_history(
        store, config, variant=current.variant, metric=current.decision_metric, limit=HISTORY_LIMIT - 1)
    return [r for r in stored if r.run_id != current.run_id] + [current]
