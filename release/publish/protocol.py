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
:mod:`kiln.tasks.wheel.variants`) gets one index for every variant,
``<channel>/wheel-variants/simple/`` (a variant's name has no '-', so no
variant's index can take the name). Its project page lists only what an
installer may choose between: every publishable variant's variant wheel
(``…-linux_x86_64-cu130.whl``), the ``null`` variant wheel, the plain default
wheel of the public version (what pip, which knows no variants, installs) and
``{name}-{version}-variants.json``, plus what goes beside the wheels in every
index (kiln-runtime, pins for all variants); never a ``+local`` wheel, which
would outrank every variant wheel. uv installs from it with ``--preview-features
wheel-variants``. The variants file is merged (:func:`kiln.release.index.variants.merge_variants`)
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
:mod:`kiln.release.index.render`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kiln.core.errors import AlreadyPublishedError, IntegrityError
from kiln.core.fsutil import sha256_bytes, sha256_file
from kiln.core.manifest import RunManifest
from kiln.core.store import Store
from kiln.core.wheels import core_metadata
from kiln.release.index.render import JSON_PAGE, ProjectStatus
from kiln.release.publish.pages import (
    IMMUTABLE_CACHE,
    check_stored,
    page_cache,
    publish_pages,
    refuse_conflicting_labels,
)
from kiln.release.publish.plan import (
    COMBINED,
    ClosureStep,
    Plan,
    Upload,
    UploadResult,
    check_closure,
    collect,
    hold_frozen,
    hold_unresolvable,
)

log = logging.getLogger(__name__)

WHEEL_TYPE = "application/octet-stream"
SIDECAR_TYPE = "text/plain; charset=utf-8"


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
    check_stored(wheel.sha256, upload.dist.sha256, upload.key)
    sidecar = None if wheel.created else store.head(upload.sidecar_key)
    if sidecar is None:
        sidecar = store.put_immutable(upload.sidecar_key, metadata, SIDECAR_TYPE, IMMUTABLE_CACHE)
    check_stored(sidecar.sha256, upload.dist.metadata_sha256, upload.sidecar_key)
    return UploadResult(upload, "added" if wheel.created else "present")


UploadStep = Callable[[Store, Sequence[Upload]], list[UploadResult]]
PagesStep = Callable[[Store, list[UploadResult]], list[str]]


def upload_each(store: Store, uploads: Sequence[Upload]) -> list[UploadResult]:
    """Every upload in turn, in this process (the flow runs each as its own task instead)."""
    return [upload_file(store, u) for u in uploads]


@dataclass(frozen=True)
class PublishRequest:
    """What a publish puts where: which of a run's wheels go to which channel, and what goes beside them."""

    channel: str  # the channel's name: its pages' cache policy (page_cache) and the plan's heading
    channel_prefix: str  # where the channel's indexes live in the target ([publish].channels)
    variants: Sequence[str]  # the variants (or matrix cells) to publish; a wheel of any other is not published
    # verified files published beside the wheels (pins, kiln-runtime): (variant, or None for every index; path)
    extra: Sequence[tuple[str | None, Path]] = ()
    untested_ok: Iterable[str] = ()  # the suites whose variants may go out untested ([publish] publish_untested)
    commit: str = ""  # a nightly's full sha: each variant's per-commit index is written too; "" (a release): none
    statuses: Mapping[str, ProjectStatus] | None = None  # PEP 792 status of projects by normalised name; else active
    # the index of each variant by name (collect): a matrix variant's cells share one; any other: its own
    indexes: Mapping[str, str] | None = None
    dry_run: bool = False  # said in the plan; the caller passes a StagingStore, so the target is untouched


@dataclass(frozen=True)
class DependencyCheck:
    """Before anything is uploaded, each variant's wheel must resolve with its dependencies (:func:`check_closure`)."""

    step: ClosureStep  # answers every dependency question at once (the flow runs it as a cached task)
    indexes: Sequence[str] = ()  # the indexes dependencies come from, behind each variant's staged index
    # a variant that does not resolve is held back and named; False: it is published, listed in ``uninstallable``
    refuses: bool = True


@dataclass(frozen=True)
class PublishSteps:
    """How a publish does what it does: the side effects, injected so that the flow and the tests supply their own."""

    # puts the wheels then their sidecars; what it returns is what reached the target (a failure is left off pages)
    upload: UploadStep = upload_each
    pages: PagesStep | None = None  # writes the pages; None: publish_pages with the channel's cache policy
    dependencies: DependencyCheck | None = None  # None: every variant is published unchecked
    clock: Callable[[], float] = time.time  # the upload time the pages record


def publish(run: RunManifest, store: Store, request: PublishRequest, steps: PublishSteps = PublishSteps()) -> Plan:
    """The whole protocol — verify, upload wheel then sidecar, then pages — in one call.

    The one path every publish takes: the publish flow passes ``upload`` and
    ``pages`` steps that run as Prefect tasks (retries, one task run per
    wheel). Conflicting files are reported in the plan and left off the
    pages; every other file is published. Against a
    :class:`~kiln.release.stores.staging.StagingStore` it is the plan of a publish
    (what the release shows its approver), with the target untouched.
    """
    uploads, skipped = collect(run, request.channel_prefix, request.variants, steps.clock, request.extra,
                               request.untested_ok, request.commit, request.statuses, request.indexes)
    uploads, frozen = hold_frozen(store, uploads)
    uploads, uninstallable = hold_uninstallable(uploads, skipped, steps.dependencies)
    uploads, refused = refuse_conflicting_labels(store, uploads)
    plan = Plan(store.url, request.channel, uploads, skipped, dry_run=request.dry_run, variants_refused=refused,
                uninstallable=uninstallable, frozen=frozen)
    plan.results = steps.upload(store, uploads)
    ready, plan.commit_held = complete_commit_indexes(uploads, plan.results)
    if refused and request.commit:  # a commit's combined index would lack the refused project: complete or absent
        ready = [replace(r, upload=replace(r.upload, commit_index="")) if r.upload.variant == COMBINED else r
                 for r in ready]
        plan.commit_held[COMBINED] = f"{', '.join(sorted(refused))} refused (see above)"
    pages = steps.pages or functools.partial(publish_pages, cache_control=page_cache(request.channel))
    plan.pages = pages(store, ready)
    written = sorted({r.upload.commit_index for r in ready if r.upload.commit_index})
    plan.commit_indexes = [index for index in written if store.get_page(f"{index}/{JSON_PAGE}") is not None]
    return plan


def hold_uninstallable(uploads: list[Upload], skipped: dict[str, str], check: DependencyCheck | None
                       ) -> tuple[list[Upload], dict[str, str]]:
    """The uploads left once ``check`` holds back what would not install (each named in ``skipped``), and the
    variants published although they would not (a check that does not refuse): ``uninstallable``."""
    unresolved = check_closure(uploads, check.indexes, check.step) if check is not None else {}
    if check is not None and not check.refuses:
        return uploads, unresolved
    skipped.update(unresolved)
    if unresolved and any(u.variant == COMBINED for u in uploads):
        skipped[COMBINED] = f"not published: variants {', '.join(sorted(unresolved))} would not install (above)"
    return hold_unresolvable(uploads, unresolved), {}


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


__all__ = [
    "DependencyCheck", "PagesStep", "PublishRequest", "PublishSteps", "UploadStep",
    "complete_commit_indexes", "hold_uninstallable", "publish", "upload_each", "upload_file",
]
