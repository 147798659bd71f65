"""A backend-built wheel, made the variant's: its local version, its dependencies, Kiln's AOT artifacts.

The project's own metadata stays as its backend wrote it (summary,
description, license, entry points, extras, the ``WHEEL`` file and tag, but
a plain ``linux_<machine>`` platform, which becomes the manylinux one its
binaries allow: :mod:`kiln.tasks.wheel.manylinux`);
only ``Version`` and ``Requires-Dist`` are rewritten (the backend's own lines
merged with ``[project] dependencies`` by :func:`merged_requires`, the torch
line pinned to the torch release series the binary was built against, or for an ``abi = "stable"`` variant
``>=`` its floor, :func:`pins_torch` and :mod:`kiln.tasks.wheel.stable_abi`), with the standard
library's email parser as ``wheel`` itself does, and the wheel is written
again with :func:`kiln.tasks.wheel.assemble.write_wheel` (``wheel.WheelFile``:
``RECORD`` recomputed). Reading goes through ``WheelFile`` too, which checks
every member against the backend's ``RECORD``, and every member is read
bounded (:func:`kiln.core.wheels.read_member`): the ones Kiln parses at
their own limits, the rest (libraries) at most a library's limit. The ``.dist-info`` and
``.data`` directories are renamed for the new version; when Kiln adds AOT
artifacts (a registry beside the backend) they land under ``<package>/_aot/``
with their manifest, as in a Kiln-built wheel.
"""

from __future__ import annotations

import email.policy
import json
import logging
from collections.abc import Sequence
from email.generator import BytesGenerator
from email.message import Message
from email.parser import BytesParser
from io import BytesIO
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from wheel.wheelfile import WheelFile

from kiln.core.errors import CompileError, MemberTooLargeError
from kiln.core.wheels import MEMBER_LIMITS, member_limit, read_member
from kiln.tasks.project.config import KilnConfig, Variant
from kiln.tasks.project.config_project import requires
from kiln.tasks.wheel.abi_audit import audit_members, check_claims
from kiln.tasks.wheel.assemble import (
    WheelInput,
    WheelStamp,
    build_info,
    platform_tag,
    requirements,
    wheel_filename,
    wheel_metadata,
    write_wheel,
)
from kiln.tasks.wheel.devicecode import MAX_LIBRARY_BYTES
from kiln.tasks.wheel.manylinux import manylinux_tag, wheel_file_tagged
from kiln.tasks.wheel.sbom import sbom_arcname, wheel_sbom
from kiln.tasks.wheel.stable_abi import untied_tag, wheel_file_retagged
from kiln.tasks.wheel.stored import ResultCache

_log = logging.getLogger(__name__)
_SIGNATURES = ("RECORD", "RECORD.jws", "RECORD.p7s")


def _parse(data: bytes) -> Message:
    return BytesParser(policy=email.policy.compat32).parsebytes(data)


def _serialise(message: Message) -> bytes:
    out = BytesIO()
    BytesGenerator(out, maxheaderlen=0).flatten(message)
    return out.getvalue()


def rewrite_metadata(data: bytes, version: str, requires: list[str]) -> bytes:
    """``METADATA`` with ``version`` and ``requires`` (every other field and the description kept)."""
    message = _parse(data)
    message.replace_header("Version", version)
    del message["Requires-Dist"]
    for requirement in requires:
        message["Requires-Dist"] = requirement
    return _serialise(message)


def _limit(name: str) -> int:
    """The most read of one member: a parsed one's own limit (METADATA, WHEEL…), else a library's."""
    return member_limit(name) if name.rsplit("/", 1)[-1] in MEMBER_LIMITS else MAX_LIBRARY_BYTES


def read_members(wheel: Path) -> tuple[str, dict[str, bytes]]:
    """(dist-info directory, {arcname: bytes}) of ``wheel``, every member checked against its RECORD, each
    read bounded (a member past its limit is a CompileError naming the wheel and the member)."""
    try:
        with WheelFile(wheel) as archive:
            members = {info.filename: read_member(archive, info.filename, wheel.name, _limit(info.filename))
                       for info in archive.infolist() if not info.is_dir()}
            return archive.dist_info_path, members
    except MemberTooLargeError as exc:
        raise CompileError(f"the backend's wheel {wheel.name}: {exc}") from exc
    except Exception as exc:  # wheel's WheelError, zipfile's BadZipFile: one translation point
        raise CompileError(f"the backend's wheel {wheel.name} is not a valid wheel: {exc}") from exc


def _key(requirement: Requirement) -> tuple[str, str, str]:
    return canonicalize_name(requirement.name), str(requirement.marker or ""), requirement.url or ""


def _joined(first: Requirement, second: Requirement) -> Requirement:
    """One requirement that asks for both: the extras of each, the specifiers of both."""
    joined = Requirement(str(first))
    joined.extras = first.extras | second.extras
    joined.specifier = first.specifier & second.specifier
    return joined


def merged_requires(own: Sequence[str], declared: Sequence[str]) -> list[str]:
    """The backend's own ``Requires-Dist`` with ``[project] dependencies`` merged in, in that order.

    A requirement of a project (canonical name) that the backend already states
    for the same marker and URL is joined with it into one line (extras and
    specifiers of both: ``torch>=2.4`` and ``torch<3`` give ``torch<3,>=2.4``);
    the others are appended. Lines are spelled as :mod:`packaging` spells them.
    """
    merged: dict[tuple[str, str, str], Requirement] = {}
    for text in (*own, *declared):
        requirement = Requirement(text)
        key = _key(requirement)
        merged[key] = _joined(merged[key], requirement) if key in merged else requirement
    return [str(r) for r in merged.values()]


def _renamed(arcname: str, old: str, new: str) -> str:
    head, sep, rest = arcname.partition("/")
    for suffix in (".dist-info", ".data"):
        if sep and head == old + suffix:
            return new + suffix + "/" + rest
    return arcname


def pins_torch(config: KilnConfig, variant: Variant, members: dict[str, bytes]) -> bool:
    """Whether the wheel's torch line is rewritten (``torch==2.14.*``; ``torch>=2.13`` for a stable variant): a
    torch extension (``[build.toolchain] torch``), or a shared library built in a variant environment with torch."""
    if config.build.toolchain.torch:
        return True
    library = any(name.endswith(".so") or ".so." in name.rsplit("/", 1)[-1] for name in members)
    return library and requires(variant.build_requires, "torch")


def rewrite_wheel(config: KilnConfig, variant: Variant, version: str, built: Path, binaries: list[WheelInput],
                  entries: list[dict[str, Any]], out_dir: Path, stamp: WheelStamp | None = None,
                  cache: ResultCache | None = None) -> Path:
    """Write the variant's wheel from the backend's ``built`` wheel into ``out_dir``; return its path."""
    stamp = stamp or WheelStamp()
    dist_info, members = read_members(built)
    tag = "-".join(built.name.removesuffix(".whl").split("-")[-3:])  # WheelFile has checked the name: PEP 427
    old = dist_info.removesuffix(".dist-info")
    wheel_file = members.get(f"{dist_info}/WHEEL", b"")
    if binaries and tag == "py3-none-any":  # a pure wheel that now carries compiled artifacts
        tag = f"py3-none-{platform_tag()}"
        wheel_file = wheel_metadata(tag, pure=False).encode()
    filename = wheel_filename(config.project.distribution, version, tag)
    new = f"{filename.split('-')[0]}-{Version(version)}"
    own = _parse(members[f"{dist_info}/METADATA"]).get_all("Requires-Dist") or []
    base = merged_requires([str(line) for line in own], config.project.dependencies)
    out = {_renamed(name, old, new): data for name, data in members.items()
           if name.rsplit("/", 1)[-1] not in _SIGNATURES or not name.startswith(dist_info + "/")}
    out[f"{new}.dist-info/WHEEL"] = wheel_file
    out[f"{new}.dist-info/kiln_build.json"] = build_info(variant, stamp).encode()
    package = config.project.package.replace(".", "/")
    for item in binaries:
        out[f"{package}/_aot/{item.arcpath}"] = item.source.read_bytes()
    if binaries:
        manifest = json.dumps(sorted(entries, key=lambda e: e["path"]), indent=2, sort_keys=True) + "\n"
        out[f"{package}/_aot/manifest.json"] = manifest.encode()
    contents = [(name, data) for name, data in out.items() if not name.startswith(f"{new}.dist-info/")]
    out[sbom_arcname(f"{new}.dist-info")] = wheel_sbom(config.project.distribution, str(Version(version)), variant,
                                                       stamp.commit, stamp.epoch, stamp.toolchain, contents,
                                                       cache)
    # the platform its binaries allow, or the declared target they must meet
    audited = manylinux_tag(tag, contents, variant.backend, cache, config.build.manylinux)
    if audited != tag:
        filename = wheel_filename(config.project.distribution, version, audited)
        out[f"{new}.dist-info/WHEEL"] = wheel_file_tagged(wheel_file, audited)
    # the ABI its tag (abi3) and its variant (abi = "stable") claim, kept before it is written
    audit = check_claims(audit_members(filename, audited, contents, torch_stable=variant.abi == "stable",
                                       cache=cache))
    untied = untied_tag(audited, audit.python_api) if variant.abi == "stable" else audited
    if untied != audited:  # a stable-ABI library with no Python C-API: one wheel for every Python 3
        _log.info("%s uses no Python C-API: tagged %s for every Python 3", filename, untied)
        filename = wheel_filename(config.project.distribution, version, untied)
        out[f"{new}.dist-info/WHEEL"] = wheel_file_retagged(out[f"{new}.dist-info/WHEEL"], untied)
    requires = requirements(config, variant, dict(stamp.toolchain), compiled=bool(binaries),
                            torch_extension=pins_torch(config, variant, members), base=tuple(base),
                            audited_torch=audit.min_torch)
    out[f"{new}.dist-info/METADATA"] = rewrite_metadata(members[f"{dist_info}/METADATA"], str(Version(version)),
                                                        requires)
    # dist-info last, as wheel builders write it (RECORD is added after it by WheelFile)
    order = sorted(out, key=lambda n: (n.startswith(f"{new}.dist-info/"), n))
    final = write_wheel(out_dir, filename, [(n, out[n]) for n in order], stamp, cache=cache)
    _log.info("wrote %s from the backend's %s (%d AOT artifacts)", final.name, built.name, len(entries))
    return final
