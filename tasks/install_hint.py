"""The facts an install hint states, read from what a publish put on each index.

Never from ``kiln.toml``: what an index holds is the projects whose files the
publish verified there (``kiln-kernels`` and ``kiln-runtime`` when both went
in), and what the project requires is the ``Requires-Dist`` of the wheel it
published (a ``pep517`` package declares its dependencies in its own build).
A nightly's hint pins the exact version it published, because pip and uv
merge the candidates of every index they are given, and an unpinned name takes
the newest final release on any of them (PyPI's ``0.8.5`` over a nightly
``0.8.2.dev…``). Whether an extra index holds such a release is looked up
(:func:`kiln.release.read.remote.newest_release`) and recorded, so the summary can
say "raise [project] version above 0.8.5".

The facts are a plain dict in ``run.json`` (info ``install``);
:mod:`kiln.flows.report.summary` renders them from there alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from packaging.metadata import parse_email
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kiln.core.wheels import core_metadata
from kiln.release.index.variants import wheel_variant_label
from kiln.release.publish.plan import COMBINED, Plan, Upload
from kiln.release.read.remote import Lookup, newest_release

log = logging.getLogger(__name__)

# "off" in Kiln's own test suite (tests/conftest.py): its runs publish with PyPI as the extra index
# and must never query it. Read once, at the edge (the publish step), like KILN_DAEMON.
CHECK_ENV = "KILN_CHECK_EXTRA_INDEXES"
LookupFn = Callable[[str, str], Lookup]


def checks_extra_indexes(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(CHECK_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def requires_dist(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA, as the wheel states them."""
    raw, _ = parse_email(core_metadata(wheel.name, wheel))
    return [str(line) for line in raw.get("requires_dist") or []]


def _by_index(plan: Plan) -> dict[str, list[Upload]]:
    """Every file a publish verified on each index (a conflicting file is not on it)."""
    found: dict[str, list[Upload]] = {}
    for result in plan.results:
        if result.outcome != "conflict":
            found.setdefault(result.upload.index, []).append(result.upload)
    return found


def index_facts(plan: Plan, distribution: str) -> dict[str, dict[str, Any]]:
    """Per index URL (as the run records it): what it holds, and the project's version and requirements there."""
    project = canonicalize_name(distribution)
    facts: dict[str, dict[str, Any]] = {}
    for index, uploads in sorted(_by_index(plan).items()):
        # of the newest version, the plain default wheel's requirements (a combined index's last, by label None)
        own = sorted((u for u in uploads if u.dist.project == project),
                     key=lambda u: (Version(u.dist.version), wheel_variant_label(u.dist.filename) is None))
        newest = own[-1] if own else None
        # a matrix variant's index: one wheel of the version per Python, pip and uv take the running one's
        pythons = sorted({t.interpreter for u in own if newest and u.dist.version == newest.dist.version
                          and u.variant != COMBINED  # a PEP 825 variant wheel's name has a label after its tag
                          for t in parse_wheel_filename(u.dist.filename)[3]}, key=lambda tag: (len(tag), tag))
        facts[f"{plan.target}/{index}/"] = {
            "holds": sorted({u.dist.project for u in uploads}),
            "version": newest.dist.version if newest else "",
            "requires": requires_dist(newest.source) if newest else [],
        } | ({"variants": True} if any(u.variant == COMBINED for u in uploads) else {}) \
          | ({"pythons": pythons} if len(pythons) > 1 else {})
    return facts


def extra_index_check(distribution: str, version: str, extra_urls: Sequence[str],
                      lookup: LookupFn = newest_release) -> dict[str, Any]:
    """Whether a final release of ``distribution`` on an extra index sorts above ``version`` (its public part).

    ``state``: ``below`` (an unpinned install takes that release), ``ok``, or
    ``unknown`` (an extra index could not be read; ``notes`` say why) — never an error.
    """
    public = Version(Version(version).public)
    lookups = [lookup(url, distribution) for url in extra_urls]
    found = [(Version(item.newest), item.index_url) for item in lookups if item.state == "found" and item.newest]
    newest = max(found, default=None)
    notes = [f"{item.index_url}: {item.reason}" for item in lookups if item.state == "unknown"]
    state = "below" if newest and newest[0] > public else "unknown" if notes else "ok"
    record: dict[str, Any] = {"state": state, "version": str(public), "notes": notes}
    if newest:
        record |= {"newest": str(newest[0]), "index": newest[1]}
    if newest and state == "below":
        log.warning("%s %s sorts below release %s on %s: an unpinned install takes that release; "
                    "raise [project] version above %s", distribution, public, newest[0], newest[1], newest[0])
    return record


def _published_version(indexes: Iterable[dict[str, Any]]) -> str:
    versions = []
    for facts in indexes:
        try:
            versions.append(Version(facts["version"]))
        except InvalidVersion:
            continue  # an index that got none of the project's wheels
    return str(max(versions)) if versions else ""


def install_facts(distribution: str, extra_urls: Sequence[str], plan: Plan, *, check: bool,
                  lookup: LookupFn = newest_release) -> dict[str, Any]:
    """The install hint's facts for one publish (``check``: look the extra indexes up)."""
    indexes = index_facts(plan, distribution)
    version = _published_version(indexes.values())
    if not version or not extra_urls:
        extra: dict[str, Any] = {"state": "ok", "notes": []}
    elif check:
        extra = extra_index_check(distribution, version, extra_urls, lookup)
    else:
        extra = {"state": "not checked", "version": str(Version(version).public), "notes": []}
    pin = plan.channel != "release" or extra["state"] == "below"
    for facts in indexes.values():
        facts["requirement"] = f"{distribution}=={facts['version']}" if pin and facts["version"] else distribution
    return {"distribution": distribution, "extra_index_urls": list(extra_urls), "indexes": indexes,
            "extra_check": extra}
