"""Test selection's records and its per-suite switch in the artifact store (``[testing.quarantine] history``).

After a suite unit ran, Kiln's step process (never the test environment) stores one document per unit and run,
create-only: ``<history>/selection/runs/<suite>.<variant>/<stamp>-<run id>/<unit>.json`` (a sharded suite's
shards each store theirs in the run's folder), and the same document in the run's own record (info
``test-selection:<unit id>``). A stored document counts only when the run it names recorded exactly it: what
else can write the store (a test's code reaching it, an operator) cannot make a failing test look carried.
The next run reads the newest earlier run's documents; one written after a failed collection carries nothing.

The switch a recall miss sets, ``<history>/selection/off/<suite>.json``, is one small document changed by
compare-and-swap; ``kiln test --selection-on SUITE`` clears it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError
from kiln.core.record import info_json, info_key, load_info
from kiln.core.store import Store
from kiln.core.swap import until_swapped
from kiln.tasks.project.config_build import Quarantine

_log = logging.getLogger(__name__)

CONTENT_TYPE = "application/json"
IMMUTABLE = "public, max-age=31536000, immutable"
SELECTION_INFO = "test-selection:"  # run info key prefix (+ unit id): the unit's records as the step stored them


@dataclass(frozen=True)
class Record:
    """One test's last word in one suite unit's history: what it did and what it depended on."""

    nodeid: str
    outcome: str
    duration_s: float
    touched: tuple[str, ...]
    fingerprint: Mapping[str, str]  # touched key -> sha256 when it last ran, or "absent"
    env_lock: str
    ran_run: str        # the run the test last actually ran in: the run a carried result names
    ran_created: float  # that run's start, Unix seconds
    carries: int = 0    # runs in a row it was carried since it ran


def _prefix(history: Quarantine) -> str:
    return f"{history.history.strip('/')}/selection"


def records_key(history: Quarantine, folder: str, unit_name: str, run_id: str, created: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(created))
    return f"{_prefix(history)}/runs/{folder}/{stamp}-{run_id}/{unit_name}.json"


def _doc(unit_id: str, run_id: str, created: float, complete: bool, records: Sequence[Record]) -> dict[str, Any]:
    return {"version": 1, "unit": unit_id, "run_id": run_id, "created": created, "complete": complete,
            "tests": [{"nodeid": r.nodeid, "outcome": r.outcome, "duration_s": r.duration_s,
                       "touched": list(r.touched), "fingerprint": dict(sorted(r.fingerprint.items())),
                       "env_lock": r.env_lock, "ran_run": r.ran_run, "ran_created": r.ran_created,
                       "carries": r.carries} for r in records]}


def _parse(doc: Any) -> dict[str, Record]:
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), list):
        raise ValueError("not a selection record (no 'tests' list)")
    found = {}
    for t in doc["tests"]:
        fingerprint = t["fingerprint"]
        if not isinstance(fingerprint, dict):
            raise ValueError("'fingerprint' must be an object")
        record = Record(str(t["nodeid"]), str(t["outcome"]), float(t["duration_s"]), tuple(map(str, t["touched"])),
                        {str(k): str(v) for k, v in fingerprint.items()}, str(t["env_lock"]), str(t["ran_run"]),
                        float(t["ran_created"]), int(t["carries"]))
        found[record.nodeid] = record
    return found


def store_records(store: Store, history: Quarantine, *, folder: str, unit_id: str, unit_name: str, run_id: str,
                  created: float, records: Sequence[Record], complete: bool) -> str:
    """Store this unit's records of this run create-only, in its run's record first, then in the history."""
    doc = _doc(unit_id, run_id, created, complete, records)
    info = f"{SELECTION_INFO}{unit_id}"
    store.put_immutable(info_key(run_id, info), info_json(info, doc), CONTENT_TYPE, "no-cache")
    key = records_key(history, folder, unit_name, run_id, created)
    store.put_immutable(key, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), CONTENT_TYPE, IMMUTABLE)
    _log.info("stored the selection records of %d tests as %s/%s", len(records), store.url, key)
    return key


def _backed(store: Store, key: str) -> tuple[Any, str]:
    """The document at ``key`` when the run it names recorded exactly it, else (None, why not)."""
    try:
        doc = json.loads(store.get(key) or b"null")
        run_id = str(doc["run_id"]) if isinstance(doc, dict) else ""
        unit = str(doc.get("unit", "")) if isinstance(doc, dict) else ""
        backed = load_info(store, run_id, f"{SELECTION_INFO}{unit}") if run_id and unit else None
    except (ValueError, KeyError, TypeError, KilnError) as exc:
        return None, f"ignored selection record {key}: {exc}"
    if backed is None or backed != doc:
        return None, f"ignored selection record {key}: run {run_id or '?'} did not record it"
    return doc, ""


def read_records(store: Store, history: Quarantine, folder: str, current_run: str,
                 tries: int = 3) -> tuple[dict[str, Record], list[str]]:
    """The records of the newest earlier run of the suite unit (every shard's, merged) that its run's record
    backs, and a line for each document ignored. A run whose collection failed leaves nothing to carry."""
    keys = store.list(f"{_prefix(history)}/runs/{folder}/")
    runs: dict[str, list[str]] = {}
    for key in keys:
        group = key.rsplit("/", 1)[0]
        if not current_run or not group.endswith(f"-{current_run}"):  # this run's other shards: not earlier
            runs.setdefault(group, []).append(key)
    ignored: list[str] = []
    for group in sorted(runs, reverse=True)[:tries]:
        found: dict[str, Record] = {}
        complete = True
        for key in runs[group]:
            doc, why = _backed(store, key)
            if doc is None:
                ignored.append(why)
                continue
            try:
                found.update(_parse(doc))
            except (ValueError, KeyError, TypeError) as exc:
                ignored.append(f"ignored selection record {key}: {exc}")
                continue
            complete = complete and bool(doc.get("complete"))
        if found or not complete:
            return (found if complete else {}), ignored
    return {}, ignored


def off_key(history: Quarantine, suite: str) -> str:
    return f"{_prefix(history)}/off/{suite}.json"


def switched_off(store: Store, history: Quarantine, suite: str) -> str:
    """Why a recall miss switched selection off for ``suite``, or "" when it is on."""
    page = store.get_page(off_key(history, suite))
    if page is None:
        return ""
    try:
        doc = json.loads(page[0])
    except ValueError:
        return f"selection is off for suite {suite} (its switch {off_key(history, suite)} is unreadable)"
    return str(doc.get("why") or "selection is off") if isinstance(doc, dict) and doc.get("off") else ""


def switch(store: Store, history: Quarantine, suite: str, why: str) -> None:
    """Turn selection off for ``suite`` (``why`` says which miss), or back on (``why`` empty)."""
    key = off_key(history, suite)
    data = (json.dumps({"off": bool(why), "why": why, "at": time.time()}, indent=1) + "\n").encode()

    def attempt() -> None:
        page = store.get_page(key)
        store.put_page(key, data, CONTENT_TYPE, "no-cache", None if page is None else page[1])

    until_swapped(f"{store.url}/{key}", attempt)
