"""One release's files for a PyPI-compatible index: chosen, re-versioned, and planned before anything moves.

:func:`prepare_upload` takes the designated variant's wheels (as the run
record holds them, already checked against their sha256) and the sdists if
the project ships any, writes each wheel under the release's public version
(:func:`kiln.release.upload.reversion.public_wheel`), reads what the index already
holds and judges every file by PyPI's rules (:func:`kiln.release.upload.pypi_plan.plan_upload`).
The flow shows the plan to the approver and, on a real release, sends the
files the plan says to send, one task run each (:func:`kiln.release.upload.twine.send_file`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError
from kiln.release.upload.pypi_index import read_index
from kiln.release.upload.pypi_plan import IndexFile, Limits, UploadPlan, plan_upload
from kiln.release.upload.reversion import public_wheel
from kiln.release.upload.twine import Endpoint, candidate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadRequest:
    """What one upload target gets of one release."""

    endpoint: Endpoint
    project: str
    version: str
    variant: str
    wheels: tuple[Path, ...]
    sdists: tuple[Path, ...] = ()
    limits: Limits = field(default_factory=Limits)


@dataclass
class PreparedUpload:
    plan: UploadPlan
    paths: dict[str, Path]  # file name -> the file to send

    def to_send(self) -> list[Path]:
        return [self.paths[c.filename] for c in self.plan.uploads]


def public_version(version: str) -> str:
    """The version PyPI gets: ``version`` without a local label; InvalidInputError naming it when not PEP 440."""
    try:
        return Version(version).public
    except InvalidVersion as exc:
        raise InvalidInputError(f"release version {version!r} is not a PEP 440 version") from exc


def _notes(request: UploadRequest, renamed: Sequence[tuple[Path, Path]]) -> list[str]:
    wheels = "; ".join(f"`{src.name}` → `{dst.name}`" + (" (same binaries; new RECORD, METADATA version and SBOM"
                                                           " version)" if src != dst else " (already public)")
                       for src, dst in renamed)
    return [f"PyPI variant: `{request.variant}`: {wheels or 'NO WHEEL in this run'}",
            "sdist: " + (", ".join(f"`{p.name}`" for p in request.sdists) or "none (the project ships wheels only)")]


def prepare_upload(request: UploadRequest, out_dir: Path, now: datetime,
                   read: Callable[[str, str], list[IndexFile]] = read_index) -> PreparedUpload:
    """Write the public wheels into ``out_dir`` and plan their upload against what the index holds."""
    version = public_version(request.version)
    renamed = [(wheel, public_wheel(wheel, out_dir)) for wheel in request.wheels]
    files = [dst for _, dst in renamed] + list(request.sdists)
    paths = {p.name: p for p in files}
    existing = read(request.endpoint.index_url, request.project)
    plan = plan_upload(request.endpoint.name, version, [candidate(p) for p in files], existing, now, request.limits)
    plan.url, plan.notes = request.endpoint.upload_url, _notes(request, renamed)
    for refused in plan.refusals:
        log.warning("upload to %s: %s", request.endpoint.name, refused.reason)
    return PreparedUpload(plan, paths)
