"""The run record: one per run, in the artifact store, never shared.

A run (a nightly, a release, one stage command) has a unique id — its Prefect
flow run id — and everything it produces lives under ``runs/<run-id>/`` in
the artifact store named by ``kiln.toml``'s ``[artifacts].url`` (a ``file://``
directory by default, ``s3://`` for teams), so a stage on any worker reads
its inputs and writes its outputs there::

    runs/<id>/run.json                   the header: flow, version, commit, tree state (written once)
    runs/<id>/units/<unit id>.json       one object per unit (variant, arch, suite, state, message)
    runs/<id>/artifacts/<path>.json      one object per artifact (path, sha256, size, step, kind)
    runs/<id>/files/<path>               the artifact's bytes (wheels, reports, results)
    runs/<id>/info/<key>.json            one object per summary fact (index URLs, the publish plan)
    runs/latest.json                     the newest run that built wheels (``--run latest``)

Every unit, artifact and info entry is its own object with a single writer,
so concurrent tasks never lose each other's updates (the record is the merge
of its objects), and rewriting one is a compare-and-swap on its ETag. A
local *view* of the run (``--out``, by default ``out/<run-id>/``) holds the
files a stage wrote or fetched and ``run.json``, the merged manifest; it is
never the source of truth.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.fsutil import atomic_write_bytes, sha256_bytes, sha256_file
from kiln.core.manifest import MANIFEST_NAME, Artifact, ArtifactKind, RunManifest, Unit, check_relative_path
from kiln.core.store import Store, check_key
from kiln.core.swap import put_until_swapped

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
FILE_TYPE = "application/octet-stream"
NO_CACHE = "no-cache"
LATEST_KEY = "runs/latest.json"
LATEST_LINK = "latest"

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Checkout:
    """The tree a run was made from: its commit and whether tracked files differ from it."""

    commit: str = ""          # full sha; "" outside a git checkout
    commit_time: int = 0      # committer time, Unix seconds
    modified: tuple[str, ...] = ()  # tracked files that differ from the commit
    in_git: bool = False

    @property
    def clean(self) -> bool:
        return self.in_git and not self.modified

    def unpublishable(self) -> str:
        """Why a run of this tree may not be published, or ""."""
        if not self.in_git:
            return "it was not built from a git checkout, so its version names no commit"
        if self.modified:
            shown = ", ".join(self.modified[:5]) + (" …" if len(self.modified) > 5 else "")
            return (f"its tracked files differ from commit {self.commit[:12]} ({shown}); commit them (or stash "
                    f"them) and run again — a local build or --dry-run still works")
        return ""


@dataclass(frozen=True)
class RunHeader:
    run_id: str
    flow: str
    version: str
    source: Checkout = Checkout()
    created: float = 0.0
    ref: str = ""
    config: str = "kiln.toml"  # the config's path relative to the repository root

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RunHeader:
        try:
            raw = json.loads(data)
            source = dict(raw.pop("source", {}))
            source["modified"] = tuple(source.get("modified", ()))
            return cls(**raw, source=Checkout(**source))
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"{where} is not a Kiln run header: {exc}") from exc


def check_run_id(run_id: str) -> str:
    if not run_id or not all(ch.isalnum() or ch in "-_" for ch in run_id):
        raise InvalidInputError(f"run id {run_id!r} must be letters, digits, '-' and '_' (a Prefect flow run id)")
    return run_id


WRITERS = 8  # concurrent writes of one batch: the store's round trips (an fsync, an HTTP request) overlap


def _concurrently(write: Callable[[T], R], items: list[T]) -> list[R]:
    """``[write(i) for i in items]``, ``WRITERS`` at a time, in order; the first error is raised after all end."""
    if len(items) < 2:
        return [write(i) for i in items]
    with ThreadPoolExecutor(min(WRITERS, len(items)), thread_name_prefix="kiln-record") as pool:
        futures = [pool.submit(write, i) for i in items]
    return [f.result() for f in futures]


def _escape(name: str) -> str:
    return quote(name, safe="")


@dataclass
class RunRecord:
    """One run's record in ``store``, with its local view at ``view``."""

    store: Store
    header: RunHeader
    view: Path
    _fetched: set[str] = field(default_factory=set, repr=False)

    @property
    def run_id(self) -> str:
        return self.header.run_id

    @property
    def prefix(self) -> str:
        return f"runs/{self.run_id}"

    # --- writing ------------------------------------------------------------

    def record(self, unit: Unit) -> Unit:
        """Write ``unit`` (replacing an earlier state of the same unit)."""
        self._put_json(f"{self.prefix}/units/{_escape(unit.id)}.json", asdict(unit))
        return unit

    def add_artifact(self, path: Path, *, step: str, kind: ArtifactKind, variant: str | None = None,
                     state: str = "ok") -> Artifact:
        """Upload ``path`` (a file inside the view) and record it with its sha256."""
        full = Path(path).resolve()
        rel = check_relative_path(full.relative_to(self.view.resolve()).as_posix())
        data = full.read_bytes()
        artifact = Artifact(rel, sha256_bytes(data), len(data), step, kind, variant, state)  # type: ignore[arg-type]
        self._put(f"{self.prefix}/files/{rel}", data, FILE_TYPE)
        self._put_json(f"{self.prefix}/artifacts/{_escape(rel)}.json", asdict(artifact))
        self._fetched.add(rel)
        return artifact

    def record_all(self, units: Iterable[Unit]) -> list[Unit]:
        """Write many units at once (each its own object: concurrent writes lose nothing)."""
        return _concurrently(self.record, list(units))

    def add_artifacts(self, items: Iterable[tuple[Path, str, ArtifactKind, str | None]]) -> list[Artifact]:
        """:meth:`add_artifact` for many ``(path, step, kind, variant)`` at once."""
        return _concurrently(lambda item: self.add_artifact(item[0], step=item[1], kind=item[2], variant=item[3]),
                             list(items))

    # Any: any JSON-serialisable value: the record keeps what the step says
    def set_info(self, key: str, value: Any) -> None:
        self._put_json(info_key(self.run_id, key), {"key": key, "value": value})

    def mark_latest(self) -> None:
        """Point ``runs/latest.json`` at this run (the newest run that built wheels)."""
        self._put_json(LATEST_KEY, {"run_id": self.run_id, "created": self.header.created})

    # Any: any JSON-serialisable value: the record keeps what the step says
    def _put_json(self, key: str, value: Any) -> None:
        self._put(key, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), JSON_TYPE)

    def _put(self, key: str, data: bytes, content_type: str) -> None:
        """Create or replace ``key`` with compare-and-swap (core/swap.py bounds it)."""
        put_until_swapped(self.store, key, data, content_type, NO_CACHE)

    # --- reading ------------------------------------------------------------

    def _read_all(self, kind: str) -> list[dict[str, Any]]:
        out = []
        for key in self.store.list(f"{self.prefix}/{kind}/"):
            data = self.store.get(key)
            if data is None:  # listed then gone: objects are never deleted, so a store glitch
                continue
            try:
                out.append(json.loads(data))
            except ValueError as exc:
                raise InvalidInputError(f"{self.store.url}/{key} is not JSON: {exc}") from exc
        return out

    def units(self) -> list[Unit]:
        return sorted((Unit(**u) for u in self._read_all("units")), key=lambda u: u.id)

    def artifacts(self) -> list[Artifact]:
        found = [Artifact(**a) for a in self._read_all("artifacts")]
        for artifact in found:
            check_relative_path(artifact.path)
        return sorted(found, key=lambda a: a.path)

    def info(self) -> dict[str, Any]:
        return {entry["key"]: entry["value"] for entry in self._read_all("info")}

    def fetch(self, artifact: Artifact) -> Path:
        """The artifact's file in the local view, downloaded if needed; its bytes match the record."""
        local = self.view / check_relative_path(artifact.path)
        if not (local.is_file() and sha256_file(local) == artifact.sha256):
            data = self.store.get(check_key(f"{self.prefix}/files/{artifact.path}"))
            if data is None:
                raise IntegrityError(f"{artifact.path}: recorded in run {self.run_id} but missing from "
                                     f"{self.store.url}/{self.prefix}/files/")
            if sha256_bytes(data) != artifact.sha256:
                raise IntegrityError(f"{artifact.path}: {self.store.url} holds sha256 {sha256_bytes(data)}, the run "
                                     f"recorded {artifact.sha256}; the file changed after it was built — rebuild it")
            atomic_write_bytes(local, data)
        return local

    def manifest(self) -> RunManifest:
        """The merged manifest: every unit, artifact and info entry of this run."""
        header = self.header
        run = RunManifest(root=self.view, run_id=header.run_id, flow=header.flow, created=header.created,
                          version=header.version, units=self.units(), artifacts=self.artifacts(), info=self.info())
        run.info.setdefault("commit", header.source.commit)
        run.fetch = self.fetch  # publishing verifies through the record, on any worker
        return run

    def write_view(self) -> Path:
        """Write ``<view>/run.json`` (the merged manifest) and point ``<out>/latest`` at the view."""
        run = self.manifest()
        atomic_write_bytes(self.view / MANIFEST_NAME, run.to_json().encode())
        link = self.view.parent / LATEST_LINK
        tmp = self.view.parent / f".{LATEST_LINK}.{os.getpid()}.{time.monotonic_ns()}"
        os.symlink(self.view.name, tmp)
        os.replace(tmp, link)  # atomic: readers see the old target or the new one
        return self.view / MANIFEST_NAME


def create_record(store: Store, header: RunHeader, out: str | Path) -> RunRecord:
    """Start the record of a new run (its header is written once; same bytes again is success)."""
    check_run_id(header.run_id)
    key = f"runs/{header.run_id}/run.json"
    store.put_immutable(key, header.to_json(), JSON_TYPE, NO_CACHE)
    view = Path(out).resolve() / header.run_id
    view.mkdir(parents=True, exist_ok=True)
    log.info("run %s: record %s/runs/%s/, local view %s", header.run_id, store.url, header.run_id, view)
    return RunRecord(store, header, view)


def resolve_run_id(store: Store, run_id: str) -> str:
    """``latest`` → the newest run that built wheels; any other id is checked and returned."""
    if run_id != "latest":
        return check_run_id(run_id)
    data = store.get(LATEST_KEY)
    if data is None:
        raise InvalidInputError(f"no run has built wheels in {store.url} yet; run `kiln build` or `kiln nightly`, "
                                f"or name a run with --run ID")
    return check_run_id(json.loads(data)["run_id"])


def open_record(store: Store, run_id: str, out: str | Path) -> RunRecord:
    """The record of an existing run (``latest`` allowed); its local view under ``out``."""
    run_id = resolve_run_id(store, run_id)
    key = f"runs/{run_id}/run.json"
    data = store.get(key)
    if data is None:
        raise InvalidInputError(f"run {run_id} has no record in {store.url} (no {key}); "
                                f"`kiln publish --run latest` names the newest run that built wheels")
    header = RunHeader.from_json(data, f"{store.url}/{key}")
    view = Path(out).resolve() / run_id
    view.mkdir(parents=True, exist_ok=True)
    return RunRecord(store, header, view)


def info_key(run_id: str, key: str) -> str:
    """Where run ``run_id`` keeps its info entry ``key``."""
    return f"runs/{check_run_id(run_id)}/info/{_escape(key)}.json"


# Any: any JSON-serialisable value: the record keeps what the step says
def info_json(key: str, value: Any) -> bytes:
    """An info entry's stored bytes (what :meth:`RunRecord.set_info` writes)."""
    return (json.dumps({"key": key, "value": value}, indent=2, sort_keys=True) + "\n").encode()


def load_info(store: Store, run_id: str, key: str) -> Any:
    """Run ``run_id``'s info entry ``key``, or None when it has none (or it is not one)."""
    where = info_key(run_id, key)
    data = store.get(where)
    if data is None:
        return None
    try:
        entry = json.loads(data)
    except ValueError as exc:
        raise InvalidInputError(f"{store.url}/{where} is not JSON: {exc}") from exc
    return entry.get("value") if isinstance(entry, dict) and entry.get("key") == key else None


def load_header(store: Store, run_id: str) -> RunHeader | None:
    data = store.get(f"runs/{check_run_id(run_id)}/run.json")
    return None if data is None else RunHeader.from_json(data, f"{store.url}/runs/{run_id}/run.json")


__all__ = ["RunHeader", "RunRecord", "Checkout", "create_record", "load_header", "open_record", "resolve_run_id"]
