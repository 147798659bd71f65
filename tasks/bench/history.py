"""Benchmark history in the artifact store: one immutable results file per run.

Keys are ``<bench.history>/<UTC timestamp>-<run id>.json``; the timestamp is
the producing run's start as its run record says (written by Kiln's step
process, never by the measured package) and fixed-width, so the store's
sorted listing is chronological and ``last`` never needs to read more than
the files it skips. Results are written create-only (same bytes again is
success), so a retried task cannot rewrite history; only results that are
what their run produced are stored (:func:`kiln.tasks.bench.trust.written_by`),
and every entry is read through a :class:`~kiln.tasks.bench.trust.HistoryReader`,
which leaves out (and reports) one its run record does not back.

``last`` is the newest stored *nightly* result of the same variant and
decision metric: an ad-hoc ``kiln bench`` on a laptop must not become the
baseline the next release is judged against.

A release is judged against the last *published release* of its channel
(``published:<channel>``), never a nightly or a dry run: after a release is
published and verified, its results are stored again under
``<bench.history>/published/<channel>/`` (same key scheme) with the release
step's credentials (no other step's IAM policy may write there), and only
those entries of release runs are read for that baseline. Nightly history lists only the direct
children of ``<bench.history>/``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.errors import AlreadyPublishedError, InvalidInputError, KilnError
from kiln.core.record import RunHeader
from kiln.core.store import Store, is_remote
from kiln.tasks.bench.results import BenchResults, load_results, parse_results
from kiln.tasks.bench.trust import RELEASE_FLOW, HistoryReader, key_name, written_by
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.runs import artifact_store

_log = logging.getLogger(__name__)

CONTENT_TYPE = "application/json"
CACHE_CONTROL = "public, max-age=31536000, immutable"
HISTORY_LIMIT = 30  # runs drawn in the trend plot
PUBLISHED = "published"  # <history>/published/<channel>/: results of published releases
PUBLISHED_COMPARE = "published:"  # --compare published:<channel>


def _prefix(config: KilnConfig) -> str:
    return config.bench.history.strip("/") + "/"


def _published_prefix(config: KilnConfig, channel: str) -> str:
    return f"{_prefix(config)}{PUBLISHED}/{channel}/"


def history_key(config: KilnConfig, header: RunHeader, channel: str | None = None) -> str:
    """``<history>/<stamp>-<run>.json`` of the run ``header`` starts; a published release's copy lives under
    ``published/<channel>/``."""
    prefix = _prefix(config) if channel is None else _published_prefix(config, channel)
    return f"{prefix}{key_name(header)}"


def store_results(store: Store, config: KilnConfig, results: BenchResults, header: RunHeader,
                  channel: str | None = None) -> str:
    """Store ``results`` of the run ``header`` starts, create-only; with ``channel``, as that channel's published
    release baseline (a release run's only). Results that are not that run's are refused, naming why."""
    problem = written_by(results, header)
    if problem:
        raise InvalidInputError(f"benchmark results not stored as history: {problem}")
    if channel is not None and header.flow != RELEASE_FLOW:
        raise InvalidInputError(f"run {header.run_id} is a {header.flow!r} run: only a release run's results become "
                                f"the {channel} channel's release baseline")
    key = history_key(config, header, channel)
    _log.info("storing benchmark results as %s/%s", store.url, key)
    store.put_immutable(key, results.to_json().encode("utf-8"), CONTENT_TYPE, CACHE_CONTROL)
    return key


def _read(reader: HistoryReader, key: str, *, published: bool = False) -> BenchResults | None:
    """A stored result the reader admits, or None (with a warning) when it vanished, does not validate, or
    its run record does not back it."""
    data = reader.store.get(key)
    if data is None:
        return None
    try:
        results = parse_results(data, f"{reader.store.url}/{key}")
    except InvalidInputError as exc:
        _log.warning("skipping unreadable history entry: %s", exc)
        return None
    return results if reader.admits(key, results, published=published) else None


def load_history(
    reader: HistoryReader, config: KilnConfig, *, variant: str, metric: str, limit: int = HISTORY_LIMIT
) -> list[BenchResults]:
    """Up to ``limit`` stored results of ``variant``/``metric``, oldest first."""
    found: list[BenchResults] = []
    for key in reversed(_nightly_keys(reader.store, config)):
        if len(found) >= limit:
            break
        results = _read(reader, key)
        if results is not None and results.variant == variant and results.decision_metric == metric:
            found.append(results)
    return found[::-1]


def _nightly_keys(store: Store, config: KilnConfig) -> list[str]:
    """Keys directly under the history prefix (published copies live one level down)."""
    prefix = _prefix(config)
    return [k for k in store.list(prefix) if "/" not in k[len(prefix):]]


def last_nightly(reader: HistoryReader, config: KilnConfig, *, variant: str, metric: str,
                 exclude_run: str = "") -> BenchResults | None:
    """The newest stored nightly result of ``variant``/``metric``, or None when there is none yet."""
    for key in reversed(_nightly_keys(reader.store, config)):
        results = _read(reader, key)
        if (results is not None and results.flow == "nightly" and results.run_id != exclude_run
                and results.variant == variant and results.decision_metric == metric):
            _log.info("baseline 'last': %s/%s (run %s)", reader.store.url, key, results.run_id)
            return results
    return None


def newest_stored(reader: HistoryReader, config: KilnConfig) -> BenchResults | None:
    """The newest result stored under the history prefix (a nightly's, or a ``kiln bench`` run's that stored
    it), of any variant: whose variant and metric ``kiln history`` shows by default."""
    for key in reversed(_nightly_keys(reader.store, config)):
        results = _read(reader, key)
        if results is not None:
            return results
    return None


def last_published(reader: HistoryReader, config: KilnConfig, channel: str, *, variant: str,
                   metric: str) -> BenchResults | None:
    """The results of the newest published release on ``channel`` of ``variant``/``metric``, or None."""
    prefix = _published_prefix(config, channel)
    for key in reversed(reader.store.list(prefix)):
        results = _read(reader, key, published=True)
        if results is not None and results.variant == variant and results.decision_metric == metric:
            _log.info("baseline: the last published %s release, %s/%s (run %s)", channel, reader.store.url, key,
                      results.run_id)
            return results
    return None


@dataclass(frozen=True)
class BaselineChoice:
    """What ``--compare`` asks for: nothing, the last nightly, a channel's last published release, a file."""

    kind: Literal["none", "last", "published", "file"]
    value: str = ""  # the channel, or the file

    def spelled(self) -> str:
        """The ``--compare`` value this choice was parsed from."""
        return {"none": "", "last": "last", "published": f"{PUBLISHED_COMPARE}{self.value}"}.get(self.kind, self.value)

    def missing(self, variant: str, metric: str) -> str:
        """Why there is nothing to compare against, for the unit messages and the release gate."""
        if self.kind == "published":
            return (f"no release published on the {self.value} channel with {variant} results measured on "
                    f"{metric} yet: nothing to compare against")
        if self.kind == "last":
            return f"no stored nightly result of variant {variant} ({metric}) yet: nothing to compare against"
        return "no baseline"


def parse_compare(compare: str | None) -> BaselineChoice:
    """``None``, ``"last"``, ``"published:<channel>"`` or a results file path."""
    if compare is None:
        return BaselineChoice("none")
    if compare == "last":
        return BaselineChoice("last")
    if compare.startswith(PUBLISHED_COMPARE):
        channel = compare[len(PUBLISHED_COMPARE):]
        if not channel or not all(ch.isalnum() or ch in "-_" for ch in channel):
            raise InvalidInputError(f"--compare {compare!r}: name a channel, e.g. 'published:release'")
        return BaselineChoice("published", channel)
    return BaselineChoice("file", compare)


def resolve_baseline(choice: BaselineChoice, current: BenchResults, config: KilnConfig,
                     reader: HistoryReader | None) -> BenchResults | None:
    """No comparison; ``"last"`` → the previous nightly (None on the first night);
    ``"published:<channel>"`` → that channel's last published release (None before the first); else a file.
    ``choice`` is :func:`parse_compare`'s, made once where ``--compare`` enters."""
    if choice.kind == "none":
        return None
    if choice.kind == "file":
        return load_results(choice.value)
    if reader is None:
        raise InvalidInputError(f"--compare {choice.spelled()} needs the artifact store, which could not be opened")
    if choice.kind == "last":
        found = last_nightly(reader, config, variant=current.variant, metric=current.decision_metric,
                             exclude_run=current.run_id)
    else:
        found = last_published(reader, config, choice.value, variant=current.variant,
                               metric=current.decision_metric)
    if found is None:
        _log.warning("%s (%s/%s)", choice.missing(current.variant, current.decision_metric), reader.store.url,
                     _prefix(config))
    return found


def check_compare(choice: BaselineChoice) -> None:
    """Validate ``--compare`` before measuring: a results file must be readable (the rest was parsed)."""
    if choice.kind == "file":
        load_results(choice.value)


def open_history(config: KilnConfig, session_factory: Callable[[], Any] | None = None) -> Store | None:
    """The history store, or None (logged) when it cannot be opened.

    ``session_factory`` gives the bench step's boto3 session; it is called only
    for an ``s3://`` store, so a local run needs no credentials. Losing history
    is a warning, not a failed benchmark; ``--compare last`` then fails clearly.
    """
    try:
        session = session_factory() if is_remote(config.artifacts.url) and session_factory else None
        return artifact_store(config, session)  # history lives in the artifact store
    except KilnError as exc:
        _log.warning("benchmark history unavailable: %s", exc)
        return None


def reader_for(store: Store | None, header: RunHeader) -> HistoryReader | None:
    """The history as the run ``header`` starts may read it (None: no store)."""
    return None if store is None else HistoryReader(store, header.created)


def store_if(enabled: bool, store: Store | None, config: KilnConfig, results: BenchResults, header: RunHeader) -> str:
    """Store ``results`` of the run ``header`` starts when asked to and a store is open; say which happened."""
    if not enabled:
        return "history not stored (store_history is off)"
    if store is None:
        return "history not stored (the artifact store could not be opened)"
    try:
        return f"stored as {store_results(store, config, results, header)}"
    except AlreadyPublishedError:  # a second benchmark of one run: its first results stay its history
        return (f"history not stored: run {header.run_id} already has other results stored as "
                f"{history_key(config, header)} (a run's history entry is written once)")


def window_history(reader: HistoryReader | None, config: KilnConfig, current: BenchResults) -> list[BenchResults]:
    """The stored runs (oldest first) the regression policy may judge ``current`` against: same variant and
    metric, a few more than its window (runs on other hardware are left out later)."""
    if reader is None:
        return []
    wanted = config.bench.regression.window * 2
    return [r for r in load_history(reader, config, variant=current.variant, metric=current.decision_metric,
                                    limit=wanted + 1) if r.run_id != current.run_id][-wanted:]


def history_with(reader: HistoryReader | None, config: KilnConfig, current: BenchResults) -> list[BenchResults]:
    """Stored history of the current variant/metric (oldest first) with ``current`` last."""
    stored = [] if reader is None else load_history(
        reader, config, variant=current.variant, metric=current.decision_metric, limit=HISTORY_LIMIT - 1)
    return [r for r in stored if r.run_id != current.run_id] + [current]
