"""The build ledger: each commit's wheels as the build step wrote them, where only the build step writes.

A run record's artifact entries and files can be rewritten by any step that writes the run (a test step
writes its reports there), so they cannot vouch for a wheel that bisect is about to install and run, or that
a release promotes (``kiln release --from-run``). The build step therefore also writes, create-only,
``build-ledger/<commit>/<variant>/<wheel name>.sha256`` for every wheel (and PEP 825 variant wheel) it
builds from a clean commit; on S3 no other step's policy may write that prefix
(:mod:`kiln.release.stores.policies`). Two builds of one commit give byte-identical wheels, so a second build
writes the same bytes (success); a build that does not reproduce keeps the first build's hash and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kiln.core.errors import AlreadyPublishedError, IntegrityError
from kiln.core.manifest import Artifact
from kiln.core.objects import Store, check_key
from kiln.core.record import RunHeader
from kiln.core.steps import BUILD_LEDGER

log = logging.getLogger(__name__)

LEDGER = BUILD_LEDGER.strip("/")  # one name: the policies deny it to every step but the build
CONTENT_TYPE = "text/plain"
IMMUTABLE = "public, max-age=31536000, immutable"
# What the build step vouches for: each variant's wheel and the variant wheels (PEP 825) made of its bytes.
LEDGER_KINDS = ("wheel", "variant-wheel")


def ledger_key(commit: str, variant: str, wheel_name: str) -> str:
    return check_key(f"{LEDGER}/{commit}/{variant}/{wheel_name}.sha256")


def record_wheel(store: Store, commit: str, variant: str, wheel_name: str, sha256: str) -> None:
    """Write the wheel's hash for ``commit``; one already there with another hash is kept (and logged)."""
    key = ledger_key(commit, variant, wheel_name)
    try:
        store.put_immutable(key, f"{sha256}\n".encode(), CONTENT_TYPE, IMMUTABLE)
    except AlreadyPublishedError:
        log.warning("%s/%s already holds another sha256 for %s: this build of %s did not reproduce the first; "
                    "bisect installs only the first build's bytes", store.url, key, wheel_name, commit[:12])


def record_wheels(store: Store, header: RunHeader, artifacts: Iterable[Artifact]) -> int:
    """Record the run's wheels in the ledger when it built a clean commit (a dirty tree names no commit)."""
    if not (header.source.clean and header.source.commit):
        return 0
    wheels = [a for a in artifacts if a.kind in LEDGER_KINDS and a.variant and a.path.endswith(".whl")]
    for artifact in wheels:
        record_wheel(store, header.source.commit, str(artifact.variant), artifact.path.rsplit("/", 1)[-1],
                     artifact.sha256)
    return len(wheels)


def recorded_sha256(store: Store, commit: str, variant: str, wheel_name: str) -> str | None:
    """The hash the build step recorded for the wheel, or None when it recorded none."""
    data = store.get(ledger_key(commit, variant, wheel_name))
    return None if data is None else data.decode(errors="replace").strip()


def vouched(store: Store, commit: str, variant: str, wheel_name: str, sha256: str, what: str) -> bool:
    """Whether the build ledger vouches for ``sha256`` as ``commit``'s ``variant`` wheel ``wheel_name``: False
    when it holds nothing for it; an :class:`IntegrityError` naming ``what`` when it holds another hash."""
    recorded = recorded_sha256(store, commit, variant, wheel_name)
    if recorded is None:
        return False
    if recorded != sha256:
        raise IntegrityError(f"refusing {what}: its sha256 is {sha256}, but the build step recorded {recorded} in "
                             f"{store.url}/{ledger_key(commit, variant, wheel_name)} — the store was changed after "
                             f"the build; nothing was installed or promoted")
    return True
