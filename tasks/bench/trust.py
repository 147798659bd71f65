"""Benchmark history entries checked against the run records they cite, by the run that reads them.

A history entry is a results file in the artifact store; its key sorts it and its ``created`` dates it. Both
must come from the run that produced it — its run record's start time, written once by Kiln's step process
(:func:`kiln.tasks.run.runs.start_run`) — never from anything the measured package could write. So an entry
counts only when the run it names has a record, started when the entry says, ran the flow it says, is stored
under the key that start time gives, and started before the run reading it (an entry "from the future" would
sort last for ever and become every later run's baseline); a release baseline must come from a release run.
Anything else is left out of every decision and named in the reading run's summary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.record import RunHeader, load_header
from kiln.core.store import Store
from kiln.tasks.bench.results import BenchResults, iso_time, parse_time

_log = logging.getLogger(__name__)

RELEASE_FLOW = "release"  # the only flow whose results become a channel's release baseline


def stamp(created: float) -> str:
    """The sortable, fixed-width time in a history key: 20261129T190227Z."""
    return iso_time(created).replace("-", "").replace(":", "")


def key_name(header: RunHeader) -> str:
    """The file name of a run's history entry: its record's start time, then its id (no path in it)."""
    run_id = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in header.run_id)
    return f"{stamp(header.created)}-{run_id}.json"


def written_by(results: BenchResults, header: RunHeader) -> str:
    """Why ``results`` are not what run ``header`` produced, or "" (checked before they are stored)."""
    if results.run_id != header.run_id:
        return f"they name run {results.run_id}, not {header.run_id}"
    if results.created != iso_time(header.created):
        return f"they are dated {results.created}, run {header.run_id} started {iso_time(header.created)}"
    if results.flow != header.flow:
        return f"they say flow {results.flow!r}, run {header.run_id} is a {header.flow!r} run"
    return ""


@dataclass
class HistoryReader:
    """Reads history for the run that started at ``until``: each entry is checked once, and each one left out
    is remembered in ``ignored`` (one line each, for the run's summary)."""

    store: Store
    until: float
    _headers: dict[str, RunHeader | None] = field(default_factory=dict, repr=False)
    _ignored: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def ignored(self) -> list[str]:
        return list(self._ignored.values())

    def _header(self, run_id: str) -> RunHeader | None:
        if run_id not in self._headers:
            self._headers[run_id] = load_header(self.store, run_id)
        return self._headers[run_id]

    def _problem(self, key: str, results: BenchResults, published: bool) -> str:
        if parse_time(results.created) > self.until:
            return f"dated {results.created}, after the run reading it started ({iso_time(self.until)})"
        try:
            header = self._header(results.run_id)
        except (InvalidInputError, IntegrityError) as exc:
            return f"its run {results.run_id!r} cannot be read ({exc})"
        if header is None:
            return f"run {results.run_id} has no record in {self.store.url}"
        problem = written_by(results, header)
        if not problem and key.rsplit("/", 1)[-1] != key_name(header):
            problem = f"it is not stored under its run's start time and id ({key_name(header)})"
        if not problem and published and header.flow != RELEASE_FLOW:
            problem = f"a release baseline from run {header.run_id}, a {header.flow!r} run, not a release"
        return problem

    def admits(self, key: str, results: BenchResults, *, published: bool = False) -> bool:
        """Whether the entry at ``key`` counts; when it does not, why is kept in :attr:`ignored`."""
        problem = self._problem(key, results, published)
        if problem and key not in self._ignored:
            self._ignored[key] = f"ignored benchmark history {self.store.url}/{key}: {problem}"
            _log.warning("%s", self._ignored[key])
        return not problem
