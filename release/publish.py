"""The publish protocol: from a run manifest to index pages, crash-safe and concurrent-safe.

Store layout. A target (``file://`` directory or ``s3://bucket/prefix``) holds
one prefix per channel (``[publish].channels`` in kiln.toml, e.g. ``nightly``)
and, under it, one PEP 503 index root per variant::

    <channel>/<variant>/simple/index.html|json               root pages
    <channel>/<variant>/simple/<project>/index.html|json     project pages
    <channel>/<variant>/simple/<project>/<wheel>             wheel (immutable)
    <channel>/<variant>/simple/<project>/<wheel>.metadata    PEP 658 sidecar (immutable)
    <channel>/<variant>/commits/<commit12>/simple/...        per-commit index (pages only)

Users install with ``--index-url <target>/<channel>/<variant>/simple/``. One
index per variant rather than per channel because the variants differ only in
their local version (``+cu130``, ``+rocm``, ``+cpu``): in one shared index
pip and uv would pick the highest local version (``rocm`` > ``cu130`` in PEP
440 ordering) whatever the machine — the reason PyTorch serves one index per
CUDA version. Everything a channel writes lives under its prefix, which is
what the generated IAM policies grant.

Per-commit index. A publish given the run's ``commit`` (every nightly; a
release has its version to pin and gets none) also writes, per variant, an
index root ``<channel>/<variant>/commits/<first 12 hex digits>/simple/``
whose pages list only what this run published to the variant's index (its
wheel, and what goes beside it: kiln-runtime, pins). It holds no file of its
own: each link is relative, up to the channel's object with the same sha256
(``../../../../simple/<project>/<wheel>#sha256=…``), so no wheel is stored
twice. Its pages are written after every channel page, by the same
compare-and-swap merge, and only for a variant whose every upload verified:
a commit's index is complete or absent.

Order (invariant 1): every wheel, then its sidecar, each verified by hash
after the write; then project pages; the root page last; then the per-commit
pages, the same way. Pages are merged
into what the channel already lists (the JSON page is the record) and written
with compare-and-swap, re-read and re-merged on a lost race, a bounded number
of times. A re-run after a crash finds the verified files present (same hash:
nothing uploaded) and finishes the pages. Every project page states the
project's PEP 792 status (``[project] status`` in kiln.toml, see
:mod:`kiln.release.index`).
"""

from __future__ import annotations

import logging
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from kiln.release.dists import Distribution
from kiln.release.errors import AlreadyPublishedError, IntegrityError, InvalidInputError
from kiln.release.fsutil import sha256_bytes
from kiln.release.index import (
    ACTIVE,
    HTML_PAGE,
    HTML_TYPE,
    JSON_PAGE,
    JSON_TYPE,
    ProjectStatus,
    group,
    parse_project_json,
    parse_root_json,
    project_pages,
    root_pages,
)
from kiln.release.manifest import RunManifest
from kiln.release.store import Store
from kiln.release.swap import until_swapped
from kiln.release.wheels import describe_wheel, read_wheel

log = logging.getLogger(__name__)

WHEEL_TYPE = "application/octet-stream"
SIDECAR_TYPE = "text/plain; charset=utf-8"
IMMUTABLE_CACHE = "public, max-age=31536000, immutable"
PAGE_CACHE = "public, max-age=60, must-revalidate"  # short: a new nightly shows within a minute

Outcome = Literal["added", "present", "conflict"]
COMMIT_DIGITS = 12  # of the commit's hex sha in a per-commit index's URL
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?\Z")  # a full SHA-1 or SHA-256 object name


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

    @property
    def key(self) -> str:
        return f"{self.index}/{self.dist.project}/{self.dist.filename}"

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
    statuses: Mapping[str, ProjectStatus] | None = None,
) -> tuple[list[Upload], dict[str, str]]:
    """The uploads of a publish, every local file verified against the manifest first.

    Nothing is written before every file has passed: a hash mismatch stops
    the publish before it touches the target. ``extra`` adds verified pinned
    files as (variant or None for all, path). ``commit``: the full sha whose
    per-commit index also lists them (empty: none). ``statuses``: the PEP 792
    status of a project by normalised name (any other: active).
    """
    for commit_variant in variants if commit else ():
        commit_index_prefix(channel_prefix, commit_variant, commit)  # a bad commit is refused before anything
    publishable, skipped = gate(run, variants, untested_ok)
    now = clock()
    uploads: list[Upload] = []
    wheels = [(a.variant, run.verify(a)) for a in run.artifacts_of("wheel") if a.state == "ok"]
    unknown = sorted({str(v) for v, _ in wheels if v is not None and v not in variants})
    if unknown:
        log.warning("wheels of variants %s are not in kiln.toml's variants %s; not published", unknown, list(variants))
    for variant_of_file, path in [*wheels, *extra]:
        dist, _ = read_wheel(path, now)  # hashed streaming; METADATA read under its limit
        for variant in publishable:
            if variant_of_file in (None, variant):
                commit_index = commit_index_prefix(channel_prefix, variant, commit) if commit else ""
                uploads.append(Upload(variant, index_prefix(channel_prefix, variant), dist, path, commit_index,
                                      (statuses or {}).get(dist.project, ACTIVE)))
    return uploads, skipped


def upload_file(store: Store, upload: Upload) -> UploadResult:
    """Put one wheel and then its sidecar, verifying both; never overwrite.

    No existence check first: the create-only write itself says whether the
    wheel was there. The same hash there is "present" (a re-run after a
    crash), another hash a conflict. The sidecar of a wheel this call created
    cannot exist yet, so it is written at once; a present wheel's sidecar is
    looked up first (a crash may have come between the two).
    """
    data = upload.source.read_bytes()
    if sha256_bytes(data) != upload.dist.sha256:
        raise IntegrityError(f"{upload.source} changed after it was verified; rebuild it, never publish it")
    _, metadata = describe_wheel(upload.dist.filename, data, upload.dist.upload_time)
    log.info("publishing %s to %s", upload.key, store.url)
    try:
        wheel = store.put_immutable(upload.key, data, WHEEL_TYPE, IMMUTABLE_CACHE)
    except AlreadyPublishedError as exc:
        return UploadResult(upload, "conflict", str(exc))
    _check(wheel.sha256, upload.dist.sha256, upload.key)
    sidecar = None if wheel.created else store.head(upload.sidecar_key)
    if sidecar is None:
        sidecar = store.put_immutable(upload.sidecar_key, metadata, SIDECAR_TYPE, IMMUTABLE_CACHE)
    _check(sidecar.sha256, upload.dist.metadata_sha256, upload.sidecar_key)
    return UploadResult(upload, "added" if wheel.created else "present")


def _check(actual: str | None, expected: str | None, key: str) -> None:
    if actual != expected:
        raise IntegrityError(f"{key}: the store holds sha256 {actual}, expected {expected}")


def _merge_files(current: list[Distribution], new: Iterable[Distribution], where: str) -> list[Distribution]:
    by_name = {d.filename: d for d in current}
    for dist in new:
        listed = by_name.get(dist.filename)
        if listed is not None and listed.sha256 != dist.sha256:
            raise IntegrityError(f"{where} lists {dist.filename} with sha256 {listed.sha256}, not {dist.sha256}")
        by_name.setdefault(dist.filename, dist)  # keep the first upload time: re-runs change no bytes
    return list(group(by_name.values()).values())[0]


def _cas_pages(store: Store, html_key: str, json_key: str, render: Callable[[bytes | None], dict[str, bytes]],
               sleep: Callable[[float], None]) -> list[str]:
    """Re-read, re-render and compare-and-swap one HTML+JSON page pair until it sticks.

    The HTML ETag is read before the JSON: an HTML written by anyone after our
    read then breaks our swap, so we never put back an HTML older than the
    JSON we merged from.
    """
    def attempt() -> list[str]:
        html, current = store.get_page(html_key), store.get_page(json_key)
        pages = render(None if current is None else current[0])
        changed = []
        for key, old, ctype in ((json_key, current, JSON_TYPE), (html_key, html, HTML_TYPE)):
            if old is None or old[0] != pages[key]:
                store.put_page(key, pages[key], ctype, PAGE_CACHE, None if old is None else old[1])
                changed.append(key)
        return changed

    return until_swapped(json_key, attempt, sleep)


def _files_at(index: str, files_in: str | None, project: str) -> str:
    """The relative URL from ``index``'s page of ``project`` to the directory of its files in ``files_in``."""
    if files_in is None or files_in == index:
        return ""
    return posixpath.relpath(f"{files_in}/{project}", f"{index}/{project}") + "/"


def update_pages(store: Store, index: str, dists: Sequence[Distribution],
                 sleep: Callable[[float], None] = time.sleep, *, statuses: Mapping[str, ProjectStatus] | None = None,
                 files_in: str | None = None) -> list[str]:
    """Merge ``dists`` (all verified on the target) into the project pages, then the root.

    ``statuses``: each project's PEP 792 status (default active), written on
    its page. ``files_in``: the index root whose objects the pages link when
    it is not ``index`` itself (a per-commit index links the channel's).
    """
    changed: list[str] = []
    projects = group(dists)
    for project, files in projects.items():
        html_key, json_key = f"{index}/{project}/{HTML_PAGE}", f"{index}/{project}/{JSON_PAGE}"

        def render(current: bytes | None, project: str = project, files: list[Distribution] = files,
                   json_key: str = json_key) -> dict[str, bytes]:
            listed = [] if current is None else parse_project_json(current, f"{store.url}/{json_key}")
            merged = _merge_files(listed, files, f"{store.url}/{json_key}")
            status = (statuses or {}).get(project, ACTIVE)
            pages = project_pages(project, merged, status, _files_at(index, files_in, project))
            return {f"{index}/{k}": v for k, v in pages.items()}

        changed += _cas_pages(store, html_key, json_key, render, sleep)

    def render_root(current: bytes | None) -> dict[str, bytes]:
        listed = [] if current is None else parse_root_json(current, f"{store.url}/{index}/{JSON_PAGE}")
        return {f"{index}/{k}": v for k, v in root_pages([*listed, *projects]).items()}

    if projects:
        changed += _cas_pages(store, f"{index}/{HTML_PAGE}", f"{index}/{JSON_PAGE}", render_root, sleep)
    return changed


UploadStep = Callable[[Store, Sequence[Upload]], list[UploadResult]]
PagesStep = Callable[[Store, list[UploadResult]], list[str]]


def upload_each(store: Store, uploads: Sequence[Upload]) -> list[UploadResult]:
    """Every upload in turn, in this process (the flow runs each as its own task instead)."""
    return [upload_file(store, u) for u in uploads]


def publish(
    run: RunManifest, store: Store, *, channel: str, channel_prefix: str, variants: Sequence[str],
    clock: Callable[[], float] = time.time, extra: Sequence[tuple[str | None, Path]] = (), dry_run: bool = False,
    untested_ok: Iterable[str] = (), upload: UploadStep = upload_each, pages: PagesStep | None = None,
    commit: str = "", statuses: Mapping[str, ProjectStatus] | None = None,
) -> Plan:
    """The whole protocol — verify, upload wheel then sidecar, then pages — in one call.

    The one path every publish takes: the publish flow passes ``upload`` and
    ``pages`` steps that run as Prefect tasks (retries, one task run per
    wheel); what a step returns is what reached the target, so a failed
    upload is left off the pages. Conflicting files are reported in the plan
    and left off the pages; every other file is published. ``commit`` (a
    nightly's full sha) also writes each variant's per-commit index;
    ``statuses`` are the PEP 792 statuses of projects by normalised name. Against a
    :class:`~kiln.release.staging.StagingStore` it is the plan of a publish
    (what the release shows its approver), with the target untouched.
    """
    uploads, skipped = collect(run, channel_prefix, variants, clock, extra, untested_ok, commit, statuses)
    plan = Plan(store.url, channel, uploads, skipped, dry_run=dry_run)
    plan.results = upload(store, uploads)
    ready, plan.commit_held = complete_commit_indexes(uploads, plan.results)
    plan.pages = (pages or publish_pages)(store, ready)
    written = sorted({r.upload.commit_index for r in ready if r.upload.commit_index})
    plan.commit_indexes = [index for index in written if store.get_page(f"{index}/{JSON_PAGE}") is not None]
    return plan


def complete_commit_indexes(uploads: Sequence[Upload], results: Sequence[UploadResult]
                            ) -> tuple[list[UploadResult], dict[str, str]]:
    """The results as the pages step gets them: a variant with an upload that did not verify loses its commit index.

    A per-commit index lists all of its variant's files or does not exist;
    the second value says, per variant held back, which files are missing.
    """
    verified = {r.upload.key for r in results if r.outcome != "conflict"}
    missing: dict[str, list[str]] = {}
    for item in uploads:
        if item.commit_index and item.key not in verified:
            missing.setdefault(item.variant, []).append(item.dist.filename)
    held = {variant: f"not every file uploaded and verified (missing: {', '.join(sorted(names))})"
            for variant, names in missing.items()}
    ready = [replace(r, upload=replace(r.upload, commit_index="")) if r.upload.variant in held else r
             for r in results]
    return ready, held


def publish_pages(store: Store, results: Iterable[UploadResult | BaseException]) -> list[str]:
    """Pages for every index that gained a verified file; failed uploads are left off.

    The channel's indexes first, then the per-commit ones (whose links lead to
    the channel's verified objects), each project page before its root.
    """
    by_index: dict[str, list[Distribution]] = {}
    by_commit: dict[tuple[str, str], list[Distribution]] = {}
    statuses: dict[str, ProjectStatus] = {}
    for result in results:
        if isinstance(result, UploadResult) and result.outcome != "conflict":
            item = result.upload
            by_index.setdefault(item.index, []).append(item.dist)
            statuses[item.dist.project] = item.status
            if item.commit_index:
                by_commit.setdefault((item.commit_index, item.index), []).append(item.dist)
    changed: list[str] = []
    for index, dists in sorted(by_index.items()):
        changed += update_pages(store, index, dists, statuses=statuses)
    for (commit_index, index), dists in sorted(by_commit.items()):
        changed += update_pages(store, commit_index, dists, statuses=statuses, files_in=index)
    return changed


def raise_for_conflict(result: UploadResult) -> UploadResult:
    """The conflict as the unit's error; its message is the store's, which says why already."""
    if result.outcome == "conflict":
        raise IntegrityError(result.message)
    return result


__all__ = [
    "PagesStep", "Plan", "Upload", "UploadResult", "UploadStep", "collect", "commit_index_prefix",
    "complete_commit_indexes", "gate", "index_prefix", "publish", "publish_pages", "raise_for_conflict",
    "update_pages", "upload_each", "upload_file",
]
