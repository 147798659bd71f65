"""Writing index pages on a target: merged into what it lists, by compare-and-swap, after the files they link.

Each project page is re-read, merged with the newly verified files (the JSON
page is the record) and written with compare-and-swap, retried on a lost race
a bounded number of times; the root page after its projects. The combined
index's variants files are merged here too, each content put immutable at its
own hash's path before the page that links it. See :mod:`kiln.release.publish.protocol`
for the order of the whole protocol and the store layout.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kiln.core.dists import Distribution, make_distribution
from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.fsutil import sha256_bytes
from kiln.core.store import Store
from kiln.core.swap import until_swapped
from kiln.release.index.render import (
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
from kiln.release.index.variants import (
    dumps,
    merge_variants,
    read_wheel_variant,
    variants_json_name,
    wheel_variant_label,
)
from kiln.release.publish.plan import COMBINED, Upload, UploadResult

log = logging.getLogger(__name__)

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


VARIANTS_TYPE = "application/json"
Documents = Mapping[tuple[str, str], Sequence[Mapping[str, Any]]]  # (project, version) -> the wheels' variant.json


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


def check_stored(actual: str | None, expected: str | None, key: str) -> None:
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
    a conflicting one refused by :func:`~kiln.release.index.variants.merge_variants`); a changed content is put,
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
        check_stored(store.put_immutable(key, data, VARIANTS_TYPE, IMMUTABLE_CACHE).sha256, digest, key)
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
    "IMMUTABLE_CACHE", "NIGHTLY_PAGE_CACHE", "PAGE_CACHE", "RELEASE_PAGE_CACHE", "RELEASE_PAGE_MAX_AGE_S",
    "VARIANTS_TYPE", "Documents", "cas_pages", "check_stored", "page_cache", "page_max_age", "publish_pages",
    "refuse_conflicting_labels", "update_pages", "variant_documents",
]
