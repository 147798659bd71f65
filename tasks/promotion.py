"""Promote the bytes that were tested: a completed nightly's wheels under the release version, not rebuilt.

:func:`promotion_refusals` says why a run cannot be promoted (not a nightly, did
not complete, a wheel that was not tested or not published, each named);
:func:`promote` re-versions each of its wheels with
:func:`kiln.release.upload.reversion.reversioned_wheel` (``0.3.0.dev20261206010203+cpu``
→ ``0.3.0+cpu``), and the PEP 825 variant wheels built beside them
(``variant-wheel`` artifacts, :mod:`kiln.tasks.wheel.variants`:
``…-0.3.0.dev20261206010203-…-cu130.whl`` → ``…-0.3.0-…-cu130.whl``, label and
``variant.json`` kept) for the release's combined index, and checks every
non-metadata member's sha256 against the nightly's wheel: the binaries a
release ships are the ones the nightly tested.

The nightly's record is no witness: the build and test steps may write it, so
a swapped wheel comes with a rewritten record. Every wheel promoted (variant
wheels too) must be the one the build step wrote in the build ledger
(:mod:`kiln.tasks.run.ledger`) for the run's commit, variant, name and sha256,
as bisect requires (:func:`ledger_refusals`); one it contradicts or does not
know is refused before anything is written.
Plain functions (no Prefect): :mod:`kiln.flows.promote` records the result.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from kiln.core.dists import parse_filename
from kiln.core.errors import IntegrityError, PermanentError
from kiln.core.fsutil import sha256_file
from kiln.core.manifest import Artifact, ArtifactKind, RunManifest, Unit
from kiln.core.objects import Store
from kiln.core.record import Checkout
from kiln.core.wheels import open_wheel
from kiln.release.upload.reversion import reversioned_wheel
from kiln.tasks.releasing import RAN
from kiln.tasks.run.ledger import vouched
from kiln.tasks.wheel.variants import VARIANT_WHEELS_DIR

FINAL_STATE_INFO = "final_state"  # the nightly's end, as its flow concluded it (kiln.flows.nightly.conclude)
PROMOTED_INFO = "promoted_from"  # in the release's record: the run whose bytes it published


class PromotionRefusedError(PermanentError):
    """The run named for promotion cannot be promoted; the message names the run and what is missing."""


@dataclass(frozen=True)
class PromotedWheel:
    variant: str
    source: str  # the nightly's wheel, as its run recorded it
    source_sha256: str
    path: Path  # the wheel under the release version
    kind: ArtifactKind = "wheel"  # or "variant-wheel": a PEP 825 variant wheel (or the plain default) of the variant


def binaries(wheel: Path) -> dict[str, str]:
    """sha256 of every member outside ``*.dist-info/`` (the files the wheel installs), by path."""
    digests: dict[str, str] = {}
    with open_wheel(wheel.name, wheel) as archive:
        for info in archive.infolist():
            head = info.filename.split("/", 1)[0]
            if not info.is_dir() and not head.endswith(".dist-info"):
                digests[_unversioned(info.filename)] = _digest(archive, info)
    return digests


def _unversioned(member: str) -> str:
    """``<name>-<version>.data/...`` named without its version, so two versions' members compare."""
    head, sep, rest = member.partition("/")
    return f"{head.split('-', 1)[0]}.data/{rest}" if sep and head.endswith(".data") else member


def _digest(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    digest = hashlib.sha256()
    with archive.open(info) as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tested(nightly: RunManifest, variant: str) -> bool:
    tests = [u for u in nightly.units if u.stage == "test" and u.variant in (None, variant)]
    return any(u.state in RAN for u in tests) and not any(u.state == "failed" for u in tests)


def _published(nightly: RunManifest, wheel: Artifact) -> bool:
    unit = f"publish/{wheel.variant}/{Path(wheel.path).name}"
    return any(u.id == unit and u.state == "completed" for u in nightly.units)


def promoted_wheels(nightly: RunManifest) -> list[Artifact]:
    return [a for a in nightly.artifacts_of("wheel") if a.state == "ok" and a.variant]


def promoted_variant_wheels(nightly: RunManifest, variants: set[str]) -> list[Artifact]:
    """The nightly's PEP 825 variant wheels (and plain default wheel) of ``variants``: the same binaries as each
    variant's wheel, under the public version, for the release's combined index."""
    return [a for a in nightly.artifacts_of("variant-wheel") if a.state == "ok" and a.variant in variants]


def promotion_refusals(nightly: RunManifest) -> list[str]:
    """Why run ``nightly`` cannot be promoted, each line naming the run (and the wheel); none: it can."""
    run = f"run {nightly.run_id}"
    if nightly.flow != "nightly":
        return [f"{run} is a {nightly.flow} run, not a nightly: only a nightly's tested wheels are promoted"]
    final = nightly.info.get(FINAL_STATE_INFO)
    if not isinstance(final, dict) or final.get("state") != "COMPLETED":
        why = final.get("message") if isinstance(final, dict) else "it recorded no end"
        return [f"{run} did not complete ({why}); promote a nightly that completed"]
    wheels = promoted_wheels(nightly)
    if not wheels:
        return [f"{run} built no wheel"]
    return [f"{run}: {Path(a.path).name} ({a.variant}) was not {what}" for a in wheels
            for what, ok in (("tested", _tested(nightly, str(a.variant))), ("published", _published(nightly, a)))
            if not ok]


def ledger_refusals(nightly: RunManifest, built_from: Checkout, ledger: Store,
                    wheels: list[tuple[Artifact, Path]]) -> list[str]:
    """Why the build ledger in ``ledger`` does not vouch for each of ``wheels`` (the nightly's artifact and its
    fetched, hash-checked file) as a build of ``built_from``; an :class:`IntegrityError` naming the wheel when it
    holds another sha256 (the wheel was swapped after the build)."""
    run = f"run {nightly.run_id}"
    if not (built_from.clean and built_from.commit):
        why = "modified: " + ", ".join(built_from.modified[:3]) if built_from.modified else "no git commit"
        return [f"{run} was not built from a clean commit ({why}), so the build ledger holds no hash for its wheels"
                " and nothing vouches for them; promote a nightly of a clean commit"]
    refused = []
    for artifact, path in wheels:
        what = f"{run}'s {artifact.variant} wheel {path.name}"
        if not vouched(ledger, built_from.commit, str(artifact.variant), path.name, sha256_file(path), what):
            refused.append(f"{run}: {path.name} ({artifact.variant}) is not in the build ledger of commit"
                           f" {built_from.commit[:12]} ({ledger.url}), so its build step did not write it; promote a"
                           " nightly whose build recorded its wheels")
    return refused


def promote(nightly: RunManifest, version: str, out_dir: Path, *, ledger: Store,
            built_from: Checkout) -> list[PromotedWheel]:
    """Each of the nightly's wheels under ``version`` (its variant's local label kept) in
    ``out_dir/<variant>/``, once the build ledger in ``ledger`` vouches for every one as a build of
    ``built_from`` (the run's header); IntegrityError when a binary differs (never expected: nothing
    rewrites them)."""
    refused = promotion_refusals(nightly)
    if refused:
        raise PromotionRefusedError("; ".join(refused))
    wheels = promoted_wheels(nightly)
    variant_wheels = promoted_variant_wheels(nightly, {str(a.variant) for a in wheels})
    sources = [(a, nightly.verify(a)) for a in [*wheels, *variant_wheels]]  # the bytes the record names
    refused = ledger_refusals(nightly, built_from, ledger, sources)
    if refused:
        raise PromotionRefusedError("; ".join(refused))
    return [_promoted(nightly, a, source, version, out_dir / VARIANT_WHEELS_DIR if a.kind == "variant-wheel"
                      else out_dir, a.kind) for a, source in sources]


def _promoted(nightly: RunManifest, artifact: Artifact, source: Path, version: str, out_dir: Path,
              kind: ArtifactKind) -> PromotedWheel:
    """One wheel of the nightly (``source``: its vouched-for bytes) under ``version`` (its local label kept, a
    variant wheel's label too), its binaries checked against the nightly's bytes."""
    local = Version(parse_filename(source.name)[1]).local
    target = str(Version(version).public) + (f"+{local}" if local else "")
    wheel = reversioned_wheel(source, out_dir / str(artifact.variant), target)
    if binaries(wheel) != binaries(source):
        raise IntegrityError(f"{wheel.name}: its binaries differ from {source.name} of run {nightly.run_id}")
    return PromotedWheel(str(artifact.variant), source.name, artifact.sha256, wheel, kind)


def inherited_units(nightly: RunManifest, variants: set[str]) -> list[Unit]:
    """The nightly's test units of the promoted variants, naming the run: what the release's bytes passed."""
    return [Unit(u.id, u.stage, u.state, u.variant, u.arch, u.kernel, u.suite,
                 f"in nightly run {nightly.run_id}: {u.message}".rstrip(": "), u.duration_s, u.cache, u.required)
            for u in nightly.units if u.stage == "test" and u.variant in (None, *variants)]


def promotion_info(nightly: RunManifest, promoted: list[PromotedWheel]) -> dict[str, object]:
    return {"run_id": nightly.run_id, "version": nightly.version, "commit": nightly.info.get("commit", ""),
            "wheels": [{"variant": p.variant, "from": p.source, "from_sha256": p.source_sha256,
                        "to": p.path.name, "kind": p.kind} for p in promoted]}
