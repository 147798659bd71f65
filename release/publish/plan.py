"""What a publish will do: the uploads of a run, gated and held back before anything is written.

:func:`collect` turns a run manifest into one :class:`Upload` per file and index
(every file verified against the manifest first); :func:`gate` decides which
variants may be published; the ``hold_*`` and :func:`check_closure` steps take
files out before the target is touched. :class:`Plan` is what a publish did or
would do. The order these run in is :func:`kiln.release.publish.protocol.publish`'s.
"""

from __future__ import annotations

import logging
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.core.dists import Distribution
from kiln.core.errors import InvalidInputError
from kiln.core.manifest import RunManifest
from kiln.core.store import Store
from kiln.core.wheels import read_wheel
from kiln.release.index.render import ACTIVE, ProjectStatus
from kiln.release.publish.closure import ClosureQuery, ClosureResult, Staged

log = logging.getLogger(__name__)

Outcome = Literal["added", "present", "conflict"]
COMMIT_DIGITS = 12  # of the commit's hex sha in a per-commit index's URL
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?\Z")  # a full SHA-1 or SHA-256 object name


COMBINED = "wheel-variants"  # the combined index of a channel's variant wheels (a variant's name has no '-')
# pip's answers, in order (kiln.release.publish.closure.resolve_all, or the publish flow's cached task runs)
ClosureStep = Callable[[Sequence[ClosureQuery]], list[ClosureResult]]


def index_prefix(channel_prefix: str, variant: str) -> str:
    return f"{channel_prefix.strip('/')}/{variant}/simple"


def commit_index_prefix(channel_prefix: str, variant: str, commit: str) -> str:
    """The per-commit index root of ``commit`` (a full hex sha) in ``variant``'s index of a channel."""
    if not _COMMIT.match(commit):
        raise InvalidInputError(f"commit {commit!r} is not a full lowercase hex commit sha; a per-commit index is "
                                "named by its first 12 digits")
    return f"{channel_prefix.strip('/')}/{variant}/commits/{commit[:COMMIT_DIGITS]}/simple"


@dataclass(frozen=True)
class Upload:
    """One local file to publish into one variant's index."""

    variant: str
    index: str  # the index root key, see :func:`index_prefix`
    dist: Distribution
    source: Path
    commit_index: str = ""  # the per-commit index that also lists it (:func:`commit_index_prefix`), or none
    status: ProjectStatus = ACTIVE  # the PEP 792 status its project's pages state
    beside: bool = False  # published beside the project's wheels (kiln-runtime, pins), not one of them

    @property
    def key(self) -> str:
        return f"{self.index}/{self.dist.project}/{self.dist.filename}"

    @property
    def index_name(self) -> str:
        """The name its index is published under (``<channel>/<name>/simple``): a matrix cell's is its variant's."""
        return posixpath.basename(posixpath.dirname(self.index))

    @property
    def sidecar_key(self) -> str:
        return self.key + ".metadata"

    @property
    def unit_id(self) -> str:
        return f"publish/{self.variant}/{self.dist.filename}"


@dataclass(frozen=True)
class UploadResult:
    upload: Upload
    outcome: Outcome
    message: str = ""


@dataclass
class Plan:
    """What a publish did (or, for a dry run, would do) on the target."""

    target: str
    channel: str
    uploads: list[Upload] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it is not published
    results: list[UploadResult] = field(default_factory=list)
    pages: list[str] = field(default_factory=list)  # keys whose bytes changed
    dry_run: bool = False
    preview: bool = False  # run against a staging copy to show what a real publish will do
    commit_indexes: list[str] = field(default_factory=list)  # per-commit index roots on the target after the pages
    commit_held: dict[str, str] = field(default_factory=dict)  # variant -> why its per-commit index is not written
    variants_refused: dict[str, str] = field(default_factory=dict)  # project -> why the combined index refused it
    uninstallable: dict[str, str] = field(default_factory=dict)  # variant -> why it will not install (published)
    frozen: dict[str, str] = field(default_factory=dict)  # "<variant>/<file>" -> why not uploaded (PEP 792)

    def commit_index_urls(self) -> list[str]:
        return [f"{self.target}/{index}/" for index in self.commit_indexes]

    def keys(self, outcome: Outcome) -> list[str]:
        return sorted(r.upload.key for r in self.results if r.outcome == outcome)

    def to_markdown(self) -> str:
        ahead = self.dry_run or self.preview
        verb = "would change" if ahead else "changed"
        kind = ", dry run" if self.dry_run else ", preview" if self.preview else ""
        lines = [f"## Publish to `{self.target}` ({self.channel}{kind})", ""]
        for title, keys in (("to add" if ahead else "added", self.keys("added")),
                            ("already present", self.keys("present")),
                            ("conflicting", self.keys("conflict")), (f"pages {verb}", sorted(self.pages))):
            lines.append(f"- {title}: {len(keys)}")
            lines.extend(f"  - `{k}`" for k in keys)
        lines.extend(f"- variant `{v}` not published: {why}" for v, why in sorted(self.skipped.items()))
        lines.extend(f"- per-commit index: `{index}/`" for index in self.commit_indexes)
        lines.extend(f"- per-commit index of `{v}` not written: {why}" for v, why in sorted(self.commit_held.items()))
        lines.extend(f"- `{p}` not published to the combined index `{COMBINED}`: {why}"
                     for p, why in sorted(self.variants_refused.items()))
        lines.extend(f"- variant `{v}` published although it will not install: {why}"
                     for v, why in sorted(self.uninstallable.items()))
        lines.extend(f"- `{k}` not uploaded: {why}" for k, why in sorted(self.frozen.items()))
        return "\n".join(lines) + "\n"


def gate(run: RunManifest, variants: Iterable[str],
         untested_ok: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
    """Variants whose build and required tests passed, and why the others are held back.

    A test unit without a variant gates every variant. A required suite that
    did not run (``not_run``: no GPU of its kind here) holds its variant back
    unless its suite is in ``untested_ok`` (``publish_untested`` in kiln.toml).
    """
    allowed = set(untested_ok)
    publishable, skipped = [], {}
    for variant in variants:
        blocking = [
            u.id for u in run.units
            if (u.stage == "build" and u.variant == variant and u.state == "failed")
            or (u.stage == "test" and u.required and u.variant in (None, variant)
                and (u.state == "failed" or (u.state == "not_run" and u.suite not in allowed)))
        ]
        if blocking:
            more = " …" if len(blocking) > 5 else ""
            skipped[variant] = f"failed or not run: {', '.join(sorted(blocking)[:5])}{more}"
        else:
            publishable.append(variant)
    return publishable, skipped


def untested(run: RunManifest, variants: Iterable[str]) -> dict[str, str]:
    """Variants whose required suites did not run on their hardware, with the reason."""
    found: dict[str, str] = {}
    for unit in sorted(run.units, key=lambda u: u.id):
        if unit.stage == "test" and unit.required and unit.state == "not_run":
            for variant in ([unit.variant] if unit.variant else list(variants)):
                found.setdefault(variant, f"{unit.suite}: {unit.message.removeprefix('not run: ')}")
    return {v: why for v, why in found.items() if v in set(variants)}


def collect(
    run: RunManifest, channel_prefix: str, variants: Sequence[str], clock: Callable[[], float] = time.time,
    extra: Sequence[tuple[str | None, Path]] = (), untested_ok: Iterable[str] = (), commit: str = "",
    statuses: Mapping[str, ProjectStatus] | None = None, indexes: Mapping[str, str] | None = None,
) -> tuple[list[Upload], dict[str, str]]:
    """The uploads of a publish, every local file verified against the manifest first.

    Nothing is written before every file has passed: a hash mismatch stops
    the publish before it touches the target. ``extra`` adds verified pinned
    files as (variant or None for all, path). ``commit``: the full sha whose
    per-commit index also lists them (empty: none). ``statuses``: the PEP 792
    status of a project by normalised name (any other: active). ``indexes``: the index a variant's files go to
    by variant name (a matrix cell's: its matrix variant's, shared by all its cells); any other: its own.
    """
    for commit_variant in variants if commit else ():  # a bad commit is refused before anything
        commit_index_prefix(channel_prefix, (indexes or {}).get(commit_variant, commit_variant), commit)
    publishable, skipped = gate(run, variants, untested_ok)
    now = clock()
    uploads: list[Upload] = []
    wheels = [(a.variant, run.verify(a)) for a in run.artifacts_of("wheel") if a.state == "ok"]
    unknown = sorted({str(v) for v, _ in wheels if v is not None and v not in variants})
    if unknown:
        log.warning("wheels of variants %s are not in kiln.toml's variants %s; not published", unknown, list(variants))
    grouped = indexes or {}
    for n, (variant_of_file, path) in enumerate([*wheels, *extra]):
        dist, _ = read_wheel(path, now)  # hashed streaming; METADATA read under its limit
        placed: set[str] = set()  # a file beside the wheels goes once into each index, however many cells share it
        for variant in publishable:
            name = grouped.get(variant, variant)
            if variant_of_file in (None, variant) and name not in placed:
                beside = n >= len(wheels)
                if beside:
                    placed.add(name)
                commit_index = commit_index_prefix(channel_prefix, name, commit) if commit else ""
                # a file beside a matrix's wheels belongs to its index, not to one cell (named as the index)
                uploads.append(Upload(name if beside else variant, index_prefix(channel_prefix, name), dist, path,
                                      commit_index, (statuses or {}).get(dist.project, ACTIVE), beside=beside))
    variant_wheels = [run.verify(a) for a in run.artifacts_of("variant-wheel")
                      if a.state == "ok" and a.variant in publishable]
    combined_commit = commit_index_prefix(channel_prefix, COMBINED, commit) if commit else ""
    for path in [*variant_wheels, *(p for v, p in extra if v is None)] if variant_wheels else ():
        dist, _ = read_wheel(path, now)
        uploads.append(Upload(COMBINED, index_prefix(channel_prefix, COMBINED), dist, path, combined_commit,
                              (statuses or {}).get(dist.project, ACTIVE), beside=path not in variant_wheels))
    return uploads, skipped


FROZEN = ("archived", "quarantined")  # PEP 792 statuses whose project takes no new file


def hold_frozen(store: Store, uploads: Sequence[Upload]) -> tuple[list[Upload], dict[str, str]]:
    """The uploads without the new files of an archived or quarantined project (PEP 792: no new uploads).

    A file the target already holds stays: its pages are rewritten (with the new status marker).
    """
    kept, frozen = [], {}
    for item in uploads:
        if item.status.status in FROZEN and store.head(item.key) is None:
            why = f"{item.dist.project} is {item.status.status} ([project] status, PEP 792): it takes no new files"
            frozen[f"{item.variant}/{item.dist.filename}"] = why
        else:
            kept.append(item)
    if frozen:
        log.warning("not uploaded (%s): %s", "PEP 792 status", ", ".join(sorted(frozen)))
    return kept, frozen


def check_closure(uploads: Sequence[Upload], dependency_indexes: Sequence[str],
                  step: ClosureStep) -> dict[str, str]:
    """Per variant, why its wheel would not install with its dependencies (:mod:`kiln.release.publish.closure`).

    Each variant's index as this publish stages it, with ``dependency_indexes`` behind it
    (:func:`closure_queries`); ``step`` answers every question at once (they are independent).
    """
    queries = closure_queries(uploads, dependency_indexes)
    refused: dict[str, str] = {}
    for query, result in zip(queries, step(queries), strict=True):
        if not result.ok and query.variant not in refused:
            refused[query.variant] = result.describe(query)
            log.error("variant %s not published: %s", query.variant, refused[query.variant])
    return refused


def closure_queries(uploads: Sequence[Upload], dependency_indexes: Sequence[str]) -> list[ClosureQuery]:
    """The dependency question of each wheel in ``uploads``, its variant's index staged as ``uploads`` holds it.
    The combined index is not asked on its own: it holds the same wheels' requirements."""
    queries = []
    for index in sorted({u.index for u in uploads if u.variant != COMBINED}):
        mine = [u for u in uploads if u.index == index]  # a matrix's index: every cell's wheel, one query each
        beside = tuple(Staged(u.dist, u.source) for u in mine if u.beside)
        queries += [ClosureQuery(u.variant, Staged(u.dist, u.source), beside, tuple(dependency_indexes))
                    for u in mine if not u.beside]
    return queries


def hold_unresolvable(uploads: Sequence[Upload], refused: Mapping[str, str]) -> list[Upload]:
    """The uploads without the refused variants', and without the combined index when any is refused
    (its page would offer a variant wheel whose dependencies do not resolve)."""
    if not refused:
        return list(uploads)
    return [u for u in uploads if u.variant not in refused and u.variant != COMBINED]


__all__ = [
    "COMBINED", "COMMIT_DIGITS", "FROZEN", "ClosureStep", "Outcome", "Plan", "Upload", "UploadResult",
    "check_closure", "closure_queries", "collect", "commit_index_prefix", "gate", "hold_frozen",
    "hold_unresolvable", "index_prefix", "untested",
]
