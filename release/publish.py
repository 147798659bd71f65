"""The publish protocol: from a run manifest to index pages, crash-safe and concurrent-safe.

Store layout. A target (``file://`` directory or ``s3://bucket/prefix``) holds
one prefix per channel (``[publish].channels`` in kiln.toml, e.g. ``nightly``)
and, under it, one PEP 503 index root per variant::

    <channel>/<variant>/simple/index.html|json               root pages
    <channel>/<variant>/simple/<project>/index.html|json     project pages
    <channel>/<variant>/simple/<project>/<wheel>             wheel (immutable)
    <channel>/<variant>/simple/<project>/<wheel>.metadata    PEP 658 sidecar (immutable)
    <channel>/<variant>/commits/<commit12>/simple/...        per-commit index (pages only)
    <channel>/wheel-variants/simple/<project>/<variant wheel>  combined index: PEP 825 variant wheels
    <channel>/wheel-variants/simple/<project>/variants/<sha256>/<name>-<version>-variants.json
                                                             its variants file, one immutable copy per content
    <channel>/wheel-variants/commits/<commit12>/simple/...   its per-commit index (pages only)

Users install with ``--index-url <target>/<channel>/<variant>/simple/``. One
index per variant rather than per channel because the variants differ only in
their local version (``+cu130``, ``+rocm``, ``+cpu``): in one shared index
pip and uv would pick the highest local version (``rocm`` > ``cu130`` in PEP
440 ordering) whatever the machine — the reason PyTorch serves one index per
CUDA version. Everything a channel writes lives under its prefix, which is
what the generated IAM policies grant.

Matrix variants. The cells of a variant with matrix axes
(``cpupy312``, ``cu130py312torch2141``) publish to the index of the variant
they came from (``indexes``: cell -> variant; ``<channel>/cpu/simple``), like
PyTorch's and flash-attention's indexes: the cells' wheels never share a name
(their Python tags, and torch labels, differ), so pip and uv take the one
whose tag fits the running Python. Each cell is still gated, uploaded and
checked on its own (its units keep its name; its dependency check asks pip as
its own Python would install, ``--python-version``); what goes beside the
wheels goes in once per index, named by the index, and a per-commit index
lists every cell's wheel or is not written.

Combined index (PEP 825). Beside the per-variant indexes, a channel whose run
built variant wheels (``variant-wheel`` artifacts, see
:mod:`kiln.tasks.build.variants`) gets one index for every variant,
``<channel>/wheel-variants/simple/`` (a variant's name has no '-', so no
variant's index can take the name). Its project page lists only what an
installer may choose between: every publishable variant's variant wheel
(``…-linux_x86_64-cu130.whl``), the ``null`` variant wheel, the plain default
wheel of the public version (what pip, which knows no variants, installs) and
``{name}-{version}-variants.json``, plus what goes beside the wheels in every
index (kiln-runtime, pins for all variants); never a ``+local`` wheel, which
would outrank every variant wheel. uv installs from it with ``--preview-features
wheel-variants``. The variants file is merged (:func:`kiln.release.variants.merge_variants`)
from the wheels' ``variant.json`` into the one the page already lists: labels
are only ever added, and a label defined again differently is refused before
anything of that project is uploaded to the combined index (the plan's
``variants_refused`` names the label; the per-variant indexes are published as
usual). The file changes as labels are added, so a page never links a mutable
object: each content is put once, immutable, at ``variants/<sha256>/`` under
the project, and the page links that copy (its name is the link's last
segment), inside the page's own compare-and-swap attempt (re-read, re-merged
on a lost race: two publishers lose no label). Its per-commit index lists the
commit's files as any other.

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
after the write; then project pages (a variants file's immutable copy just
before the page that links it); the root page last; then the per-commit
pages, the same way. Pages are merged
into what the channel already lists (the JSON page is the record) and written
with compare-and-swap, re-read and re-merged on a lost race, a bounded number
of times. A re-run after a crash finds the verified files present (same hash:
nothing uploaded) and finishes the pages. Every project page states the
project's PEP 792 status (``[project] status`` in kiln.toml, see
:mod:`kiln.release.index`).
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kiln.core.dists import Distribution, make_distribution
from kiln.core.errors import AlreadyPublishedError, IntegrityError, InvalidInputError
from kiln.core.fsutil import sha256_bytes, sha256_file
from kiln.core.manifest import RunManifest
from kiln.core.store import Store
from kiln.core.swap import until_swapped
from kiln.core.wheels import core_metadata, read_wheel
from kiln.release.closure import ClosureQuery, ClosureResult, Staged
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
    variants_file_path,
)
from kiln.release.variants import dumps, merge_variants, read_wheel_variant, variants_json_name, wheel_variant_label

log = logging.getLogger(__name__)

WHEEL_TYPE = "application/octet-stream"
SIDECAR_TYPE = "text/plain; charset=utf-8"
# Cache-Control by object kind (a CDN in front of the target obeys it; a file:// target has no headers).
# Wheels, sidecars and variants files: their keys are never re-used (invariant 2), so cached for a year.
IMMUTABLE_CACHE = "public, max-age=31536000, immutable"
# Pages change on every publish. A nightly's must show at once: a CDN revalidates every request.
NIGHTLY_PAGE_CACHE = "no-cache"
# A release's change once per release: a CDN may serve one up to 5 minutes old (purge it to show one sooner).
RELEASE_PAGE_MAX_AGE_S = 300
RELEASE_PAGE_CACHE = f"public, max-age={RELEASE_PAGE_MAX_AGE_S}"
PAGE_CACHE = NIGHTLY_PAGE_CACHE  # a page written outside a channel's publish (a rollback, a prune): revalidated


def page_cache(channel: str) -> str:
    """The Cache-Control of ``channel``'s index pages: short on ``release``, ``no-cache`` on every other."""
    return RELEASE_PAGE_CACHE if channel == "release" else NIGHTLY_PAGE_CACHE


def page_max_age(channel: str) -> float:
    """How long a cache in front may serve ``channel``'s previous pages (seconds): :func:`page_cache`'s max-age."""
    return RELEASE_PAGE_MAX_AGE_S if channel == "release" else 0.0

Outcome = Literal["added", "present", "conflict"]
COMMIT_DIGITS = 12  # of the commit's hex sha in a per-commit index's URL
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?\Z")  # a full SHA-1 or SHA-256 object name


COMBINED = "wheel-variants"  # the combined index of a channel's variant wheels (a variant's name has no '-')
VARIANTS_TYPE = "application/json"
Documents = Mapping[tuple[str, str], Sequence[Mapping[str, Any]]]  # (project, version) -> the wheels' variant.json
# pip's answers, in order (kiln.release.closure.resolve_all, or the publish flow's cached task runs)
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
    """Per variant, why its wheel would not install with its dependencies (:mod:`kiln.release.closure`).

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


def variant_documents(uploads: Iterable[Upload]) -> dict[str, dict[tuple[str, str], list[dict[str, Any]]]]:
    """Per index, the ``variant.json`` of each variant wheel it gets, by (project, version)."""
    found: dict[str, dict[tuple[str, str], list[dict[str, Any]]]] = {}
    for item in uploads:
        if item.variant == COMBINED and wheel_variant_label(item.dist.filename) is not None:
            document = read_wheel_variant(item.dist.filename, item.source)
            for index in filter(None, (item.index, item.commit_index)):
                found.setdefault(index, {}).setdefault((item.dist.project, item.dist.version), []).append(document)
    return found


def _published_variants(store: Store, files_dir: str, listed: Sequence[Distribution],
                        name: str) -> tuple[Distribution | None, dict[str, Any] | None]:
    """The variants file ``name`` a page lists, and its document (read from its copy, checked by hash)."""
    current = next((d for d in listed if d.filename == name), None)
    if current is None:
        return None, None
    key = f"{files_dir}/{current.project}/{variants_file_path(name, current.sha256)}"
    data = store.get(key)
    if data is None or sha256_bytes(data) != current.sha256:
        raise IntegrityError(f"{key}: listed with sha256 {current.sha256}, the store holds "
                             f"{'nothing' if data is None else sha256_bytes(data)}")
    try:
        return current, dict(json.loads(data))
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"{key} is not a JSON object: {exc}") from exc


def refuse_conflicting_labels(store: Store, uploads: Sequence[Upload]) -> tuple[list[Upload], dict[str, str]]:
    """The uploads without the combined index's files of a project whose labels conflict with the published ones.

    Checked before anything is uploaded (invariant 7): a variant label the combined index's variants file
    already defines with other properties refuses every combined-index file of that project (its per-variant
    indexes are not affected); the second value says why, per project. The pages re-check under their
    compare-and-swap (another publisher may have added the label since).
    """
    refused: dict[str, str] = {}
    for index, by_version in variant_documents(u for u in uploads if u.variant == COMBINED).items():
        if "/commits/" in index:
            continue
        for (project, version), documents in sorted(by_version.items()):
            page = store.get(f"{index}/{project}/{JSON_PAGE}")
            listed = [] if page is None else parse_project_json(page, f"{store.url}/{index}/{project}/{JSON_PAGE}")
            _, existing = _published_variants(store, index, listed, variants_json_name(project, version))
            try:
                merge_variants(existing, documents)
            except InvalidInputError as exc:
                refused.setdefault(project, f"{exc}; nothing of {project} was published to {index}/")
    if refused:
        log.error("not published to the combined index: %s", "; ".join(refused.values()))
    return [u for u in uploads if not (u.variant == COMBINED and u.dist.project in refused)], refused


def upload_file(store: Store, upload: Upload) -> UploadResult:
    """Put one wheel and then its sidecar, verifying both; never overwrite.

    No existence check first: the create-only write itself says whether the
    wheel was there. The same hash there is "present" (a re-run after a
    crash), another hash a conflict. The sidecar of a wheel this call created
    cannot exist yet, so it is written at once; a present wheel's sidecar is
    looked up first (a crash may have come between the two). The wheel is
    hashed and sent streaming; the store checks that what it wrote has the
    hash verified here, so a file changed in between is an IntegrityError.
    """
    digest = sha256_file(upload.source)  # streamed: a wheel of gigabytes is never held in memory
    metadata = core_metadata(upload.dist.filename, upload.source)  # only its METADATA member, under its limit
    if digest != upload.dist.sha256 or sha256_bytes(metadata) != upload.dist.metadata_sha256:
        raise IntegrityError(f"{upload.source} changed after it was verified; rebuild it, never publish it")
    log.info("publishing %s to %s", upload.key, store.url)
    try:
        wheel = store.put_immutable_file(upload.key, upload.source, digest, WHEEL_TYPE, IMMUTABLE_CACHE)
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


def cas_pages(store: Store, html_key: str, json_key: str, render: Callable[[bytes | None], dict[str, bytes]],
              sleep: Callable[[float], None], cache_control: str = PAGE_CACHE) -> list[str]:
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
                store.put_page(key, pages[key], ctype, cache_control, None if old is None else old[1])
                changed.append(key)
        return changed

    return until_swapped(json_key, attempt, sleep)


def _files_at(index: str, files_in: str | None, project: str) -> str:
    """The relative URL from ``index``'s page of ``project`` to the directory of its files in ``files_in``."""
    if files_in is None or files_in == index:
        return ""
    return posixpath.relpath(f"{files_in}/{project}", f"{index}/{project}") + "/"


def _variants_files(store: Store, files_dir: str, project: str, listed: list[Distribution],
                    files: Sequence[Distribution],
                    documents: Documents) -> tuple[list[Distribution], list[Distribution]]:
    """(``listed`` without the variants files that change, their new records) for ``project``'s page.

    Each version's variants file is the one the page lists merged with ``documents`` (labels only added,
    a conflicting one refused by :func:`~kiln.release.variants.merge_variants`); a changed content is put,
    immutable and verified, at its own hash's path before the page that links it is written.
    """
    new: list[Distribution] = []
    for (of, version), docs in sorted(documents.items()):
        if of != project:
            continue
        name = variants_json_name(project, version)
        current, existing = _published_variants(store, files_dir, listed, name)
        data = dumps(merge_variants(existing, docs))
        digest = sha256_bytes(data)
        if current is not None and current.sha256 == digest:
            continue
        key = f"{files_dir}/{project}/{variants_file_path(name, digest)}"
        _check(store.put_immutable(key, data, VARIANTS_TYPE, IMMUTABLE_CACHE).sha256, digest, key)
        when = max((d.upload_time for d in files if d.version == version), default=0)
        listed = [d for d in listed if d.filename != name]
        new.append(make_distribution(name, digest, len(data), when))
    return listed, new


def update_pages(store: Store, index: str, dists: Sequence[Distribution],
                 sleep: Callable[[float], None] = time.sleep, *, statuses: Mapping[str, ProjectStatus] | None = None,
                 files_in: str | None = None, variants: Documents | None = None,
                 cache_control: str = PAGE_CACHE) -> list[str]:
    """Merge ``dists`` (all verified on the target) into the project pages, then the root.

    ``statuses``: each project's PEP 792 status (default active), written on
    its page. ``files_in``: the index root whose objects the pages link when
    it is not ``index`` itself (a per-commit index links the channel's).
    ``variants``: the variant wheels' ``variant.json`` by (project, version),
    merged into each version's listed variants file (the combined index). ``cache_control``: the
    pages' (:func:`page_cache` of the channel).
    """
    changed: list[str] = []
    projects = group(dists)
    for project, files in projects.items():
        html_key, json_key = f"{index}/{project}/{HTML_PAGE}", f"{index}/{project}/{JSON_PAGE}"

        def render(current: bytes | None, project: str = project, files: list[Distribution] = files,
                   json_key: str = json_key) -> dict[str, bytes]:
            listed = [] if current is None else parse_project_json(current, f"{store.url}/{json_key}")
            added: list[Distribution] = []
            if variants:
                listed, added = _variants_files(store, files_in or index, project, listed, files, variants)
            merged = _merge_files(listed, [*files, *added], f"{store.url}/{json_key}")
            status = (statuses or {}).get(project, ACTIVE)
            pages = project_pages(project, merged, status, _files_at(index, files_in, project))
            return {f"{index}/{k}": v for k, v in pages.items()}

        changed += cas_pages(store, html_key, json_key, render, sleep, cache_control)

    def render_root(current: bytes | None) -> dict[str, bytes]:
        listed = [] if current is None else parse_root_json(current, f"{store.url}/{index}/{JSON_PAGE}")
        return {f"{index}/{k}": v for k, v in root_pages([*listed, *projects]).items()}

    if projects:
        changed += cas_pages(store, f"{index}/{HTML_PAGE}", f"{index}/{JSON_PAGE}", render_root, sleep,
                             cache_control)
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
    commit: str = "", statuses: Mapping[str, ProjectStatus] | None = None, closure: ClosureStep | None = None,
    dependency_indexes: Sequence[str] = (), closure_refuses: bool = True, indexes: Mapping[str, str] | None = None,
) -> Plan:
    """The whole protocol — verify, upload wheel then sidecar, then pages — in one call.

    The one path every publish takes: the publish flow passes ``upload`` and
    ``pages`` steps that run as Prefect tasks (retries, one task run per
    wheel); what a step returns is what reached the target, so a failed
    upload is left off the pages. Conflicting files are reported in the plan
    and left off the pages; every other file is published. ``commit`` (a
    nightly's full sha) also writes each variant's per-commit index;
    ``statuses`` are the PEP 792 statuses of projects by normalised name. ``closure``: before anything
    is uploaded, each variant's wheel must resolve with its dependencies from its staged index and
    ``dependency_indexes`` (:func:`check_closure`); a variant that does not is held back, named (with
    ``closure_refuses`` False it is published and listed in the plan's ``uninstallable``). Against a
    :class:`~kiln.release.staging.StagingStore` it is the plan of a publish
    (what the release shows its approver), with the target untouched. ``indexes``: the index of each variant
    by name (:func:`collect`): a matrix variant's cells share one.
    """
    uploads, skipped = collect(run, channel_prefix, variants, clock, extra, untested_ok, commit, statuses, indexes)
    uploads, frozen = hold_frozen(store, uploads)
    unresolved = check_closure(uploads, dependency_indexes, closure) if closure is not None else {}
    uninstallable = {} if closure_refuses else unresolved
    if closure_refuses:
        skipped.update(unresolved)
        if unresolved and any(u.variant == COMBINED for u in uploads):
            skipped[COMBINED] = f"not published: variants {', '.join(sorted(unresolved))} would not install (above)"
        uploads = hold_unresolvable(uploads, unresolved)
    uploads, refused = refuse_conflicting_labels(store, uploads)
    plan = Plan(store.url, channel, uploads, skipped, dry_run=dry_run, variants_refused=refused,
                uninstallable=uninstallable, frozen=frozen)
    plan.results = upload(store, uploads)
    ready, plan.commit_held = complete_commit_indexes(uploads, plan.results)
    if refused and commit:  # a commit's combined index would lack the refused project: complete or absent
        ready = [replace(r, upload=replace(r.upload, commit_index="")) if r.upload.variant == COMBINED else r
                 for r in ready]
        plan.commit_held[COMBINED] = f"{', '.join(sorted(refused))} refused (see above)"
    plan.pages = (pages or functools.partial(publish_pages, cache_control=page_cache(channel)))(store, ready)
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
    for item in uploads:  # by index: a matrix's per-commit index lists every cell's wheel, or is not written
        if item.commit_index and item.key not in verified:
            missing.setdefault(item.index_name, []).append(item.dist.filename)
    held = {name: f"not every file uploaded and verified (missing: {', '.join(sorted(names))})"
            for name, names in missing.items()}
    ready = [replace(r, upload=replace(r.upload, commit_index="")) if r.upload.index_name in held else r
             for r in results]
    return ready, held


def publish_pages(store: Store, results: Iterable[UploadResult | BaseException],
                  cache_control: str = PAGE_CACHE) -> list[str]:
    """Pages for every index that gained a verified file; failed uploads are left off.

    The channel's indexes first, then the per-commit ones (whose links lead to
    the channel's verified objects), each project page before its root;
    each written with ``cache_control`` (:func:`page_cache` of the channel).
    """
    by_index: dict[str, list[Distribution]] = {}
    by_commit: dict[tuple[str, str], list[Distribution]] = {}
    statuses: dict[str, ProjectStatus] = {}
    verified: list[Upload] = []
    for result in results:
        if isinstance(result, UploadResult) and result.outcome != "conflict":
            item = result.upload
            verified.append(item)
            by_index.setdefault(item.index, []).append(item.dist)
            statuses[item.dist.project] = item.status
            if item.commit_index:
                by_commit.setdefault((item.commit_index, item.index), []).append(item.dist)
    documents = variant_documents(verified)
    changed: list[str] = []
    for index, dists in sorted(by_index.items()):
        changed += update_pages(store, index, dists, statuses=statuses, variants=documents.get(index),
                                cache_control=cache_control)
    for (commit_index, index), dists in sorted(by_commit.items()):
        changed += update_pages(store, commit_index, dists, statuses=statuses, files_in=index,
                                variants=documents.get(commit_index), cache_control=cache_control)
    return changed


__all__ = [
    "COMBINED", "IMMUTABLE_CACHE", "NIGHTLY_PAGE_CACHE", "PAGE_CACHE", "RELEASE_PAGE_CACHE", "ClosureStep",
    "PagesStep", "Plan", "Upload", "UploadResult", "UploadStep", "cas_pages", "check_closure", "closure_queries",
    "collect", "commit_index_prefix", "complete_commit_indexes", "gate", "hold_frozen",
    "hold_unresolvable", "index_prefix", "page_cache", "page_max_age", "publish", "publish_pages",
    "refuse_conflicting_labels", "update_pages", "upload_each", "upload_file", "variant_documents",
]
