"""The release's own decisions: version checks, the publish gate, page rollback.

Plain functions (no Prefect): :mod:`kiln.flows.release` orders them. The store is
passed in, so tests hand in a local directory or an S3 server on loopback.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.core.errors import ConfigError, InvalidInputError
from kiln.core.fsutil import atomic_write_bytes, atomic_write_text
from kiln.core.manifest import RunManifest
from kiln.core.objects import BotoSession
from kiln.core.store import Store, is_remote, open_store
from kiln.core.swap import put_until_swapped
from kiln.release.index.render import HTML_PAGE, HTML_TYPE, JSON_PAGE, JSON_TYPE, parse_project_json
from kiln.release.publish.pages import PAGE_CACHE
from kiln.release.publish.plan import COMBINED, Plan, untested
from kiln.release.read.fetch import StoreSettings
from kiln.release.read.remote import newest_release
from kiln.tasks import install_hint
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.bisect import runs_by_commit
from kiln.tasks.run.source import describe

log = logging.getLogger(__name__)

PAGE_NAMES = (HTML_PAGE, JSON_PAGE)
# Prefect's state types, the words a stage's final state is given in (tests check it against prefect's StateType).
StateName = Literal["SCHEDULED", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "CRASHED", "PAUSED",
                    "CANCELLING"]
COMPLETED: StateName = "COMPLETED"
RAN = ("completed", "flaky", "failed")  # the unit states of a suite that ran on its variant's wheel



def channel_prefix(config: KilnConfig, channel: str) -> str:
    """The store prefix of ``channel``; an unknown channel is a clear error."""
    channels = dict(config.publish.channels)
    if channel not in channels:
        raise ConfigError(f"unknown channel {channel!r}; kiln.toml [publish] channels are {sorted(channels)}")
    return str(channels[channel]).strip("/")


def open_target(config: KilnConfig, out: str, session: BotoSession | None = None, target: str | None = None) -> Store:
    """The publish target's store (``{out}`` in a ``file://`` URL is the ``--out`` directory)."""
    name = target or config.publish.default_target
    spec = config.publish.targets[name]
    url = spec.url.replace("{out}", str(Path(out).resolve()))
    return open_store(url, root=config.root, region=spec.region, endpoint=spec.endpoint,
                      expected_owner=spec.expected_owner, session=session,
                      verifies_checksums=spec.verifies_checksums, public=spec.public)


def store_settings_for(config: KilnConfig, url: str, session: BotoSession | None = None) -> StoreSettings:
    """How to open an ``s3://`` index URL: the settings of the publish target in that bucket.

    The default target wins when several share the bucket; a bucket no target
    names is opened with boto3's defaults (region and endpoint from the environment).
    """
    bucket = urlsplit(url).netloc
    targets = sorted(config.publish.targets.items(), key=lambda item: item[0] != config.publish.default_target)
    for _, spec in targets:
        if is_remote(spec.url) and urlsplit(spec.url).netloc == bucket:
            return StoreSettings(spec.region, spec.endpoint, spec.expected_owner, session)
    log.info("no publish target in kiln.toml names bucket %r; opening %s with boto3's defaults", bucket, url)
    return StoreSettings(session=session)


def install_info(config: KilnConfig, plan: Plan, env: Mapping[str, str] = os.environ,
                 lookup: install_hint.LookupFn = newest_release) -> dict[str, Any]:
    """What a run records for its install hint, read from what ``plan`` published (never from kiln.toml).

    :mod:`kiln.flows.report.summary` renders it from run.json alone. ``env`` says whether
    the extra indexes are looked up (:data:`kiln.tasks.install_hint.CHECK_ENV`), ``lookup`` how.
    """
    return install_hint.install_facts(config.project.distribution, list(config.publish.extra_index_urls), plan,
                                      check=install_hint.checks_extra_indexes(env), lookup=lookup)


def without_suite(run: RunManifest, variants: Iterable[str]) -> dict[str, str]:
    """Variants no test suite ran on (none covers them, or every one that does was not run), with the reason.

    A test unit without a variant tested every variant. Required suites that were
    not run are :func:`kiln.release.publish.plan.untested`'s; they are named there.
    """
    tests = [u for u in run.units if u.stage == "test"]
    found: dict[str, str] = {}
    for variant in variants:
        mine = [u for u in tests if u.variant in (None, variant)]
        if any(u.state in RAN for u in mine):
            continue
        why = "; ".join(sorted({f"{u.suite or u.id}: {u.message.splitlines()[0] if u.message else u.state}"
                                for u in mine}))
        found[variant] = f"no suite ran on {variant} ({why})" if mine else f"no suite covers {variant}"
    return found


def held_untested(config: KilnConfig, run: RunManifest) -> dict[str, str]:
    """Variants held back because no suite ran on them and kiln.toml [publish] publish_untested = false."""
    if config.publish.publish_untested:
        return {}
    built = sorted({str(a.variant) for a in run.artifacts_of("wheel") if a.state == "ok" and a.variant})
    return {v: f"not published: {why}, and kiln.toml [publish] publish_untested = false holds it back"
            for v, why in without_suite(run, built).items()}


def variants_to_publish(config: KilnConfig, run: RunManifest) -> tuple[list[str], dict[str, str]]:
    """kiln.toml's variants less those :func:`held_untested` holds back, and why each of those is held."""
    held = held_untested(config, run)
    return [v.name for v in config.variants if v.name not in held], held


def publish_indexes(config: KilnConfig) -> dict[str, str]:
    """The index each matrix cell publishes to: its matrix variant's (``cpupy312`` -> ``cpu``), one index holding
    every cell's wheel, where pip and uv pick the one whose Python tag fits. A variant without axes: its own."""
    return {v.name: v.cell.matrix for v in config.variants if v.cell is not None}


def untested_ok(config: KilnConfig) -> list[str]:
    """The suites whose variants may go out when they could not run: none when the project says so."""
    return [s.name for s in config.suites if s.publish_untested and config.publish.publish_untested]


def publish_facts(config: KilnConfig, run: RunManifest, plan: Plan, env: Mapping[str, str] = os.environ,
                  lookup: install_hint.LookupFn = newest_release) -> dict[str, Any]:
    """What a publish records for the summary: untested variants, variants no suite ran on, the install hint."""
    # the combined index is no variant, nor a matrix's index its files beside the wheels are named by
    published = sorted({u.variant for u in plan.uploads if u.variant != COMBINED and not u.beside})
    not_run = untested(run, published)
    return {"published_untested": not_run,
            "published_without_suite": without_suite(run, [v for v in published if v not in not_run]),
            "install": install_info(config, plan, env, lookup)}


def _project_pages(store: Store, prefix: str, distribution: str) -> list[str]:
    name = canonicalize_name(distribution)
    return [k for k in store.list(f"{prefix}/") if k.endswith(f"/{name}/{JSON_PAGE}")]


def published_versions(store: Store, prefix: str, distribution: str) -> list[Version]:
    """Public versions of ``distribution`` on every index under ``prefix`` (all variants)."""
    versions: set[Version] = set()
    for key in _project_pages(store, prefix, distribution):
        data = store.get(key)
        if data is None:  # listed, then gone: a page is never deleted, so only a race with a test
            continue
        for dist in parse_project_json(data, key):
            versions.add(Version(Version(dist.version).public))
    return sorted(versions)


def release_commits(store: Store, version: str) -> set[str]:
    """The commits (clean trees) of the release runs of ``version`` the artifact store holds."""
    wanted = Version(version)
    return {commit for commit, headers in runs_by_commit(store).items()
            if any(h.flow == "release" and _same_version(h.version, wanted) for h in headers)}


def _same_version(text: str, wanted: Version) -> bool:
    try:
        return Version(text) == wanted
    except InvalidVersion:
        return False


def clean_commit(root: Path) -> str:
    """The commit checked out at ``root`` when its tracked files are unchanged, else ''."""
    checkout = describe(root)
    return checkout.commit if checkout.in_git and not checkout.modified else ""


def check_release_version(version: str, channel: str, published: Iterable[Version], commit: str = "",
                          released_from: Callable[[], Iterable[str]] = tuple) -> str:
    """The normalised version, or :class:`InvalidInputError` saying why it cannot be released.

    A version already published is resumed when ``commit`` (this checkout's clean commit) is among
    ``released_from()`` (the commits of its stored release runs, read only then): the release completes what
    is missing, and publishing keeps what is there with the same bytes (other bytes are refused there, by
    name). Published from another commit, or with no release run to say which, it is refused."""
    try:
        wanted = Version(version)
    except InvalidVersion:
        raise InvalidInputError(f"version {version!r} is not a PEP 440 version (e.g. 1.2.0, 1.2.0rc1)") from None
    if wanted.local:
        raise InvalidInputError(f"version {version!r} has a local part; each variant adds its own (+cu130)")
    published = sorted(published)
    if wanted in published:
        origins = sorted(released_from()) if commit else []
        if commit and commit in origins:
            log.info("version %s is already published on the %s channel from commit %s: resuming its release "
                     "(what is there with the same bytes is kept, what is missing is completed)", wanted, channel,
                     commit[:12])
            return str(wanted)
        source = ("and this checkout has uncommitted changes (or is no git checkout), so nothing says it is the"
                  " same release" if not commit else
                  f"from commit {', '.join(c[:12] for c in origins)}, not this checkout's {commit[:12]}" if origins
                  else "and no release run of it in the artifact store says from which commit")
        raise InvalidInputError(f"version {wanted} is already published on the {channel} channel {source}; "
                                f"published versions are immutable — choose a new version")
    if published and wanted < published[-1]:
        raise InvalidInputError(f"version {wanted} is lower than the last {channel} release {published[-1]}; "
                                f"a release must be greater than every published version")
    return str(wanted)


@dataclass(frozen=True)
class GateDecision:
    """Whether the release may go on to approval, and the lines that say why (for the summary)."""

    passed: bool
    lines: tuple[str, ...]

    @property
    def message(self) -> str:
        return "\n".join(self.lines)


def _window_head(comparison: Mapping[str, Any]) -> str:
    """What the regression policy judged: cases over a window, and what fell back to the single baseline."""
    window = comparison.get("window") or {}
    head = (f"benchmarks judged by the regression policy over the last {window.get('runs', 0)} comparable runs on "
            f"this hardware ({window.get('judged', 0)} cases)")
    short = int(window.get("insufficient") or 0)
    if short:
        against = (f"compared with the last published release (run {comparison['baseline_run']})"
                   if comparison.get("baseline_run") else "not compared: no published release yet")
        head += f"; {short} cases with insufficient data (too few comparable runs) {against}"
    return head


def _bench_lines(comparison: Mapping[str, Any] | None, bench: str = "") -> tuple[str, list[str], list[str]]:
    """(what the bench was compared with, blocking regressions, advisory regressions); ``bench``: why the bench
    stage compared nothing (a package with no bench cases, say)."""
    if not comparison:
        return (f"benchmarks: not compared: {bench}" if bench else "benchmarks were not compared"), [], []
    if (comparison.get("window") or {}).get("judged"):
        return _window_head(comparison), list(comparison.get("blocking") or []), \
            list(comparison.get("advisory") or [])
    if not comparison.get("baseline_run"):
        notes = comparison.get("notes") or ["no baseline"]
        return f"benchmarks: {notes[0]}; the gate passes on build and tests", [], []
    against = (f"the last published release (run {comparison['baseline_run']}, {comparison.get('compared', 0)} "
               f"cases, threshold {float(comparison.get('threshold', 0)):.0%})")
    return f"benchmarks compared with {against}", list(comparison.get("blocking") or []), \
        list(comparison.get("advisory") or [])


def _suspicious_lines(comparison: Mapping[str, Any] | None) -> list[str]:
    suspicious = list(((comparison or {}).get("window") or {}).get("suspicious") or [])
    if not suspicious:
        return []
    return [f"suspicious ({len(suspicious)}; slower than the threshold but inside the window's noise band — "
            f"reported, not blocking):", *(f"  {line}" for line in suspicious)]


def gate_decision(stages: Mapping[str, tuple[StateName, str]], comparison: Mapping[str, Any] | None,
                  allow_regressions: str | None, bench_note: str = "") -> GateDecision:
    """Decide whether the release may go on to approval and publishing.

    ``stages`` maps a stage name to its final state's (type, message);
    ``comparison`` is what the bench stage recorded (:func:`kiln.tasks.bench.compare.comparison_record`).
    A failed build or test always stops the release. A failed bench stops it unless
    ``allow_regressions`` gives the reason. A regression is the window policy's ``regressed``
    (or, for a case with too few comparable runs, the single baseline's); ``suspicious`` cases
    are listed and never stop it. Regressions on metrics that do not block (CPU timings, by
    default) are listed as advisory and never stop it. ``bench_note``: why the bench stage compared
    nothing (its not-run unit's message), said in place of a comparison.
    """
    failed = {name: message for name, (kind, message) in stages.items() if kind != COMPLETED}
    head, blocking, advisory = _bench_lines(comparison, bench_note)
    stopped = {n: m for n, m in failed.items() if n != "bench" or not allow_regressions}
    lines = [head]
    if stopped:
        detail = "; ".join(f"{n}: {(m or 'failed').splitlines()[0]}" for n, m in sorted(stopped.items()))
        lines = [f"release stopped before publishing — {detail}", head]
        if blocking:
            lines += [f"blocking regressions ({len(blocking)}):", *(f"  {line}" for line in blocking),
                      "to publish anyway, give the reason: kiln release --allow-regressions REASON"]
        return GateDecision(False, tuple(lines))
    if allow_regressions and ("bench" in failed or blocking or advisory):
        lines.append(f"published despite benchmark regressions, because: {allow_regressions}"
                     + (f" ({failed['bench'].splitlines()[0]})" if "bench" in failed else ""))
        lines += [f"  {line}" for line in blocking + advisory]
    elif advisory:
        metrics = comparison.get("blocking_metrics") if comparison else None
        lines.append(f"advisory regressions ({len(advisory)}; only {metrics or 'every metric'} timings block "
                     f"a release — kiln.toml [bench] blocking_metrics):")
        lines += [f"  {line}" for line in advisory]
    lines += _suspicious_lines(comparison)
    lines.append("build, tests and benchmarks passed the gate")
    return GateDecision(True, tuple(lines))


def snapshot_pages(store: Store, prefix: str, directory: Path) -> list[str]:
    """Copy every index page under ``prefix`` to ``directory`` before publishing.

    On disk rather than in memory so that a rollback can still run after the
    publishing process crashed. Returns the keys saved.
    """
    keys = [k for k in store.list(f"{prefix}/") if k.rsplit("/", 1)[-1] in PAGE_NAMES]
    for key in keys:
        data = store.get(key)
        if data is not None:
            atomic_write_bytes(directory / "pages" / key, data)
    atomic_write_text(directory / "pages.json", json.dumps({"prefix": prefix, "keys": keys}, indent=2) + "\n")
    log.info("saved %d index pages under %s/ to %s", len(keys), prefix, directory)
    return keys


def _restore_one(store: Store, key: str, old: bytes) -> bool:
    content_type = HTML_TYPE if key.endswith(HTML_PAGE) else JSON_TYPE
    return put_until_swapped(store, key, old, content_type, PAGE_CACHE)


def restore_pages(store: Store, directory: Path) -> dict[str, list[str]]:
    """Put every saved page back byte for byte; report what changed and what is new.

    Project pages first and root pages last, the publishing order. Pages that
    did not exist before stay (nothing Kiln does deletes), but the restored
    root pages no longer link to them, and every wheel they name still exists.
    """
    saved = json.loads((directory / "pages.json").read_text())
    keys: list[str] = saved["keys"]
    ordered = sorted(keys, key=lambda k: (k.count("/"), k), reverse=True)
    restored = [k for k in ordered if _restore_one(store, k, (directory / "pages" / k).read_bytes())]
    now = [k for k in store.list(f"{saved['prefix']}/") if k.rsplit("/", 1)[-1] in PAGE_NAMES]
    new = sorted(set(now) - set(keys))
    log.warning("rolled back %d index pages under %s/ (new pages left unlinked: %d)",
                len(restored), saved["prefix"], len(new))
    return {"restored": sorted(restored), "new": new}
