"""Retention of a channel's indexes (``kiln prune``): yank older nightlies, then remove them.

Per variant index (``<channel>/<variant>/simple``, the combined
``wheel-variants`` one too) and per project, the newest ``keep`` versions
stay; the files of every older version are candidates. A candidate is first
**yanked** (PEP 592, with a reason naming the date it goes) and recorded in
the index's ledger, ``<channel>/<variant>/retention.json`` (a page written
with compare-and-swap: ``{"files": {"<project>/<filename>": {"yanked_at",
"sha256"}}}``). Once ``grace_days`` have passed since it was recorded, it is
**removed**: off the channel's project page, then every per-commit index that
lists it is deleted (root page first), then its objects (the file, its PEP
658 sidecar) — only when no page left anywhere in the channel links them —
and last its ledger entry. With ``grace_days = 0`` one prune does both.

Never pruned: the newest ``keep`` versions of each project in each index (so
never a project's last version), the release channel (refused), and an
object any remaining page links (reported, retried by the next prune).
Raising ``keep`` un-yanks what is then inside it.

Crash safety, the publish protocol's invariants at every instant: pages are
rewritten before anything they linked is deleted, a per-commit index goes
root page first, and every step is idempotent and driven by what the store
holds (the ledger keeps a removal pending until its objects are gone), so a
prune killed anywhere and run again completes. Pages change only by
compare-and-swap, re-read and re-merged on a lost race: a publish racing a
prune loses no entry (:func:`kiln.release.publish.pages.cas_pages`).

Deletion is not part of the :class:`~kiln.core.objects.Store` protocol
(nothing that publishes can delete); a prune needs a store that also has
``delete`` (:class:`DeletingStore`, the local and S3 ones), opened with the
prune step's own credentials (``kiln policies``: ``prune-nightly`` may delete
only under the nightly prefix).
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote

from packaging.utils import canonicalize_name

from kiln.core.dists import VARIANTS_JSON_SUFFIX, Distribution, check_sha256, parse_filename
from kiln.core.errors import InvalidInputError
from kiln.core.objects import Store
from kiln.core.swap import until_swapped
from kiln.release.index.render import (
    HTML_PAGE,
    JSON_PAGE,
    VARIANTS_DIR,
    ProjectStatus,
    parse_project_json,
    parse_root_json,
    project_pages,
    variants_file_path,
)
from kiln.release.publish.pages import cas_pages

log = logging.getLogger(__name__)

LEDGER = "retention.json"
_DAY = 86400


@runtime_checkable
class DeletingStore(Store, Protocol):
    """A store that can also delete (only a prune opens one)."""

    def delete(self, key: str) -> None:
        """Remove ``key``; a key already gone is success."""


@dataclass(frozen=True)
class Retention:
    keep: int  # newest versions kept per project and variant index
    grace_days: float  # between the yank and the removal

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise InvalidInputError(f"retention keep = {self.keep}: at least 1 (a project keeps its newest version)")
        if self.grace_days < 0:
            raise InvalidInputError(f"retention grace_days = {self.grace_days} must not be negative")


@dataclass
class PrunePlan:
    """What a prune did (or, with ``dry_run``, would do); keys relative to the target."""

    target: str
    channel: str
    retention: Retention
    dry_run: bool = False
    yanked: list[str] = field(default_factory=list)
    unyanked: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # files taken off their channel page
    commit_indexes: list[str] = field(default_factory=list)  # per-commit index roots deleted
    deleted: list[str] = field(default_factory=list)  # objects deleted
    held: dict[str, str] = field(default_factory=dict)  # object -> why it was not deleted (yet)
    ignored: dict[str, str] = field(default_factory=dict)  # ledger entry -> why it is not one Kiln wrote
    waiting: dict[str, str] = field(default_factory=dict)  # file -> when its grace period ends

    @property
    def changed(self) -> bool:
        return bool(self.yanked or self.unyanked or self.removed or self.commit_indexes or self.deleted)

    def to_markdown(self) -> str:
        verb = "would" if self.dry_run else "did"
        lines = [f"## Prune `{self.target}` ({self.channel}{', dry run' if self.dry_run else ''}: keep "
                 f"{self.retention.keep}, grace {self.retention.grace_days:g} days)", ""]
        for title, keys in ((f"yank ({verb})", self.yanked), (f"un-yank ({verb}; now inside keep)", self.unyanked),
                            (f"remove from pages ({verb})", self.removed),
                            (f"delete per-commit indexes ({verb})", self.commit_indexes),
                            (f"delete objects ({verb})", self.deleted)):
            lines.append(f"- {title}: {len(keys)}")
            lines.extend(f"  - `{k}`" for k in sorted(keys))
        lines.extend(f"- yanked, removed after {when}: `{k}`" for k, when in sorted(self.waiting.items()))
        lines.extend(f"- not deleted: `{k}`: {why}" for k, why in sorted(self.held.items()))
        lines.extend(f"- ignored ledger entry `{k}`: {why}" for k, why in sorted(self.ignored.items()))
        if not self.changed:
            lines.append("- nothing to prune")
        return "\n".join(lines) + "\n"


@dataclass
class _Index:
    """One variant index of the channel as the prune read it."""

    root: str  # <channel>/<variant>/simple
    pages: dict[str, list[Distribution]]  # project -> files listed
    ledger: dict[str, dict[str, Any]]  # "<project>/<filename>" -> {"yanked_at", "sha256"}

    @property
    def listed(self) -> set[str]:
        """``"<project>/<filename>"`` of every file the channel's pages list."""
        return {f"{project}/{d.filename}" for project, files in self.pages.items() for d in files}

    @property
    def ledger_key(self) -> str:
        return f"{posixpath.dirname(self.root)}/{LEDGER}"

    def key(self, entry: str) -> str:
        return f"{self.root}/{entry}"


def prune(store: DeletingStore, *, channel: str, channel_prefix: str, retention: Retention,
          release_prefix: str = "release", clock: Callable[[], float] = time.time, dry_run: bool = False,
          sleep: Callable[[float], None] = time.sleep) -> PrunePlan:
    """Apply ``retention`` to every variant index of ``channel`` on ``store`` (see the module docstring)."""
    prefix = channel_prefix.strip("/")
    release = release_prefix.strip("/")
    if channel == "release" or not prefix or prefix == release or f"{prefix}/".startswith(f"{release}/") \
            or f"{release}/".startswith(f"{prefix}/"):
        raise InvalidInputError(f"channel {channel!r} (prefix {prefix!r}) shares the release channel's prefix "
                                f"{release!r}: releases are never pruned")
    now = int(clock())
    plan = PrunePlan(store.url, channel, retention, dry_run)
    indexes = [_read_index(store, root, plan) for root in variant_indexes(store, prefix)]
    due = {ix.root: _yank_phase(store, ix, retention, now, plan, dry_run, sleep) for ix in indexes}
    for ix in indexes:
        _remove_phase(store, ix, due[ix.root], plan, dry_run, sleep)
    # A dry run changed no page: what still links a due object is any page but the ones the prune rewrites
    # (the channel's, which drop it) or deletes (the per-commit indexes listing it).
    unseen = {ix.root for ix in indexes} | set(plan.commit_indexes) if dry_run else set()
    linked = links_under(store, prefix, unseen)
    for ix in indexes:
        _delete_phase(store, ix, due[ix.root], linked, plan, dry_run, sleep)
    log.info("prune of %s/%s%s: %d yanked, %d removed, %d objects deleted", store.url, prefix,
             " (dry run)" if dry_run else "", len(plan.yanked), len(plan.removed), len(plan.deleted))
    return plan


def variant_indexes(store: Store, prefix: str) -> list[str]:
    """The index roots ``<prefix>/<variant>/simple`` the channel holds."""
    roots = set()
    for key in store.list(f"{prefix}/"):
        parts = key[len(prefix) + 1:].split("/")
        if len(parts) == 3 and parts[1:] == ["simple", JSON_PAGE]:
            roots.add(f"{prefix}/{parts[0]}/simple")
    return sorted(roots)


def _read_index(store: Store, root: str, plan: PrunePlan) -> _Index:
    data = store.get(f"{root}/{JSON_PAGE}")
    projects = [] if data is None else parse_root_json(data, f"{store.url}/{root}/{JSON_PAGE}")
    pages = {}
    for project in projects:
        page = store.get(f"{root}/{project}/{JSON_PAGE}")
        if page is not None:
            pages[project] = parse_project_json(page, f"{store.url}/{root}/{project}/{JSON_PAGE}")
    ledger_data = store.get(f"{posixpath.dirname(root)}/{LEDGER}")
    ledger = {} if ledger_data is None else _parse_ledger(ledger_data, root)
    return _Index(root, pages, _checked_ledger(ledger, pages, root, plan))


def _checked_ledger(ledger: Mapping[str, dict[str, Any]], pages: Mapping[str, list[Distribution]], root: str,
                    plan: PrunePlan) -> dict[str, dict[str, Any]]:
    """The ledger's entries that name a distribution file of a project this index lists; the others are
    ignored and named in the plan. The ledger is a page anyone with the publisher's rights can write: an
    entry naming a page (``kiln-kernels/index.html``), a path out of its project or another project's
    file must never become a delete."""
    kept = {}
    for entry, value in ledger.items():
        why = ledger_entry_problem(entry, value, pages)
        if why is None:
            kept[entry] = value
        else:
            plan.ignored[f"{root}/{entry}"] = why
            log.warning("prune: ignored %s/%s in %s: %s", root, entry, LEDGER, why)
    return kept


def ledger_entry_problem(entry: str, value: Mapping[str, Any], pages: Mapping[str, list[Distribution]]) -> str | None:
    """Why ``entry`` is not a retention entry Kiln wrote for this index, or None."""
    project, _, filename = entry.partition("/")
    if project not in pages:
        return f"{project!r} is not a project of this index"
    if not filename or "/" in filename:
        return "not <project>/<filename>"
    try:
        name, _ = parse_filename(filename)
        check_sha256(value.get("sha256"), "sha256")
    except InvalidInputError as exc:
        return str(exc)
    if canonicalize_name(name) != canonicalize_name(project):
        return f"{filename!r} is a file of {name!r}, not of {project!r}"
    listed = {d.filename: d.sha256 for d in pages[project]}
    if filename in listed and listed[filename] != value["sha256"]:
        return f"its sha256 is not the {listed[filename]} the page lists for {filename!r}"
    return None


def _parse_ledger(data: bytes, root: str) -> dict[str, dict[str, Any]]:
    try:
        files = json.loads(data)["files"]
        return {str(k): {"yanked_at": int(v["yanked_at"]), "sha256": str(v["sha256"])} for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{posixpath.dirname(root)}/{LEDGER} is not a retention ledger Kiln wrote: "
                                f"{exc!r}; fix or remove it by hand") from exc


def candidates(pages: Mapping[str, list[Distribution]], keep: int) -> dict[str, Distribution]:
    """``{"<project>/<filename>": file}`` of every version older than each project's newest ``keep``."""
    from packaging.version import Version

    found = {}
    for project, files in pages.items():
        versions = sorted({d.version for d in files}, key=Version, reverse=True)
        old = set(versions[keep:])
        found.update({f"{project}/{d.filename}": d for d in files if d.version in old})
    return found


def _yank_phase(store: Store, ix: _Index, retention: Retention, now: int, plan: PrunePlan, dry_run: bool,
                sleep: Callable[[float], None]) -> dict[str, dict[str, Any]]:
    """Yank new candidates and record them; un-yank what ``keep`` now covers. Returns the entries due."""
    old = candidates(ix.pages, retention.keep)
    listed = ix.listed
    stale = sorted(e for e in ix.ledger if e in listed and e not in old)
    new = sorted(e for e, d in old.items() if e not in ix.ledger)
    grace = int(retention.grace_days * _DAY)
    plan.yanked += [ix.key(e) for e in new]
    plan.unyanked += [ix.key(e) for e in stale]
    ledger = {e: v for e, v in ix.ledger.items() if e not in stale}
    ledger.update({e: {"yanked_at": now, "sha256": old[e].sha256} for e in new})
    if not dry_run and (new or stale):
        until = _date(now + grace)
        reason = (f"older than the newest {retention.keep} nightlies of this index; kiln prune removes it after "
                  f"{until}")
        _rewrite(store, ix.root, {e: reason for e in new} | {e: None for e in stale}, sleep)

        def record(current: dict[str, Any]) -> dict[str, Any]:
            return {**{k: v for k, v in current.items() if k not in stale}, **{e: ledger[e] for e in new}}

        _swap_ledger(store, ix.ledger_key, record, sleep)
    due = {e: v for e, v in ledger.items() if v["yanked_at"] + grace <= now}
    for entry, value in ledger.items():
        if entry not in due:
            plan.waiting[ix.key(entry)] = _date(value["yanked_at"] + grace)
    return due


def _remove_phase(store: DeletingStore, ix: _Index, due: Mapping[str, Any], plan: PrunePlan, dry_run: bool,
                  sleep: Callable[[float], None]) -> None:
    """Take the due files off the channel's pages, then delete every per-commit index that lists one."""
    if not due:
        return
    listed = ix.listed
    plan.removed += [ix.key(e) for e in sorted(due) if e in listed]
    gone = {ix.key(e) for e in due} | {_object_key(ix, e, v) for e, v in due.items()}
    commit_roots = _commit_indexes_linking(store, posixpath.dirname(ix.root), gone)
    plan.commit_indexes += commit_roots
    if dry_run:
        return
    _rewrite(store, ix.root, {e: False for e in due}, sleep)
    for root in commit_roots:
        delete_index(store, root)


def _delete_phase(store: DeletingStore, ix: _Index, due: Mapping[str, Any], linked: Mapping[str, str],
                  plan: PrunePlan, dry_run: bool, sleep: Callable[[float], None]) -> None:
    """Delete the due files' objects no page links any more; then forget the entries whose objects are gone."""
    done = []
    for entry, value in sorted(due.items()):
        keys = _object_keys(store, ix, entry, value)
        held = [k for k in keys if k in linked]
        for key in held:
            plan.held[key] = f"still linked by {linked[key]}"
        if held:
            continue
        changed = _changed_object(store, ix, entry, value)
        if changed is not None:
            plan.held[changed[0]] = changed[1]
            continue
        plan.deleted += keys
        if not dry_run:
            for key in keys:
                store.delete(key)
        done.append(entry)
    if done and not dry_run:
        _swap_ledger(store, ix.ledger_key, lambda current: {k: v for k, v in current.items() if k not in done}, sleep)


def _object_keys(store: Store, ix: _Index, entry: str, value: Mapping[str, Any]) -> list[str]:
    """What a removed entry leaves in the store: a wheel and its sidecar; a variants file's every content
    copy (one per time labels were added to it, each under its own hash)."""
    key = _object_key(ix, entry, value)
    if not entry.endswith(VARIANTS_JSON_SUFFIX):
        return [key, key + ".metadata"]
    project, filename = entry.split("/", 1)
    copies = [k for k in store.list(f"{ix.root}/{project}/{VARIANTS_DIR}/") if k.endswith(f"/{filename}")]
    return sorted({key, *copies})


def _changed_object(store: Store, ix: _Index, entry: str, value: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, why) when the object the entry names holds other bytes than the ledger recorded for it."""
    key = _object_key(ix, entry, value)
    info = store.head(key)
    if info is None or info.sha256 is None or info.sha256 == value["sha256"]:
        return None
    return key, f"its sha256 {info.sha256} is not the {value['sha256']} {LEDGER} recorded for it"


def _object_key(ix: _Index, entry: str, value: Mapping[str, Any]) -> str:
    project, filename = entry.split("/", 1)
    if filename.endswith(VARIANTS_JSON_SUFFIX):  # listed by name, stored at its content's own path
        return f"{ix.root}/{project}/{variants_file_path(filename, value['sha256'])}"
    return ix.key(entry)


def _rewrite(store: Store, root: str, changes: Mapping[str, str | bool | None],
             sleep: Callable[[float], None]) -> None:
    """Per project, set each file's yank reason (a string), un-yank it (None) or drop it (False); by CAS."""
    by_project: dict[str, dict[str, str | bool | None]] = {}
    for entry, change in changes.items():
        project, filename = entry.split("/", 1)
        by_project.setdefault(project, {})[filename] = change
    for project, edits in sorted(by_project.items()):
        json_key = f"{root}/{project}/{JSON_PAGE}"

        def render(current: bytes | None, project: str = project, edits: Mapping[str, Any] = edits,
                   json_key: str = json_key) -> dict[str, bytes]:
            if current is None:
                raise InvalidInputError(f"{store.url}/{json_key} disappeared during the prune")
            listed = parse_project_json(current, f"{store.url}/{json_key}")
            kept = [_edited(d, edits[d.filename]) if d.filename in edits else d for d in listed
                    if edits.get(d.filename, True) is not False]
            pages = project_pages(project, kept, page_status(current))
            return {f"{root}/{k}": v for k, v in pages.items()}

        cas_pages(store, f"{root}/{project}/{HTML_PAGE}", json_key, render, sleep)


def _edited(dist: Distribution, change: str | bool | None) -> Distribution:
    if change is None:
        return dist._replace(yanked=None)
    return dist if dist.yanked is not None else dist._replace(yanked=str(change))


def page_status(page: bytes) -> ProjectStatus:
    """The PEP 792 status a project page states (active when it states none)."""
    marker = json.loads(page).get("project-status") or {}
    return ProjectStatus(marker.get("status", "active"), marker.get("reason", ""))


def _swap_ledger(store: Store, key: str, change: Callable[[dict[str, Any]], dict[str, Any]],
                 sleep: Callable[[float], None]) -> None:
    def attempt() -> None:
        current = store.get_page(key)
        files = {} if current is None else _parse_ledger(current[0], posixpath.dirname(key) + "/simple")
        data = (json.dumps({"files": change(files)}, indent=1, sort_keys=True) + "\n").encode()
        if current is None or current[0] != data:
            store.put_page(key, data, "application/json", "no-cache", None if current is None else current[1])

    until_swapped(f"{store.url}/{key}", attempt, sleep)


def _commit_indexes_linking(store: Store, variant_dir: str, keys: set[str]) -> list[str]:
    """The per-commit index roots under ``variant_dir/commits/`` with a page that links one of ``keys``."""
    found = []
    for root, pages in _pages_by_root(store, f"{variant_dir}/commits/").items():
        if any(target in keys for page in pages for target in page_links(store, page)):
            found.append(root)
    return sorted(found)


def _pages_by_root(store: Store, prefix: str) -> dict[str, list[str]]:
    """JSON pages under ``prefix`` grouped by the index root (``…/simple``) they belong to."""
    roots: dict[str, list[str]] = {}
    for key in store.list(prefix):
        if key.endswith(f"/{JSON_PAGE}") and "/simple/" in key:
            roots.setdefault(key[: key.rindex("/simple/") + len("/simple")], []).append(key)
    return roots


def page_links(store: Store, page_key: str) -> list[str]:
    """The store keys the files of a JSON project page link (a root page links none)."""
    data = store.get(page_key)
    if data is None:
        return []
    try:
        files = json.loads(data).get("files") or []
        base = posixpath.dirname(page_key)
        return [posixpath.normpath(f"{base}/{unquote(str(f['url']).split('#', 1)[0])}") for f in files]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{store.url}/{page_key} is not a PEP 691 page: {exc!r}") from exc


def links_under(store: Store, prefix: str, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, str]:
    """``{object key: a page linking it}`` over every JSON page under ``prefix`` (but the index roots in
    ``skip``), with their sidecars."""
    linked: dict[str, str] = {}
    for root, pages in _pages_by_root(store, f"{prefix}/").items():
        if root in skip:
            continue
        for page in pages:
            for key in page_links(store, page):
                linked.setdefault(key, page)
                linked.setdefault(key + ".metadata", page)
    return linked


def delete_index(store: DeletingStore, root: str) -> None:
    """Delete a per-commit index's pages: the root page first (HTML, then JSON), then every project page.
    A per-commit index stores only pages (its links reach the channel's objects), so only pages are
    deleted: anything else under its root is not Kiln's and stays."""
    for name in (HTML_PAGE, JSON_PAGE):
        store.delete(f"{root}/{name}")
    for key in store.list(f"{root}/"):
        if posixpath.basename(key) in (HTML_PAGE, JSON_PAGE):
            store.delete(key)


def _date(when: int) -> str:
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def open_for_prune(store: Store) -> DeletingStore:
    """``store`` as a :class:`DeletingStore`; a clear error for a backend that cannot delete."""
    if not isinstance(store, DeletingStore):
        raise InvalidInputError(f"{store.url}: this store cannot delete objects, so it cannot be pruned")
    return store


__all__ = ["LEDGER", "DeletingStore", "PrunePlan", "Retention", "candidates", "delete_index", "links_under",
           "open_for_prune", "page_links", "page_status", "prune", "variant_indexes"]
