"""A CycloneDX SBOM in every wheel (PEP 770): what built it, from which commit, and every binary it holds.

Written as ``<name>-<version>.dist-info/sboms/kiln.cdx.json`` by the build's wheel writers
(:func:`kiln.tasks.wheel.assemble.build_wheel`, :func:`kiln.tasks.wheel.rewheel.rewrite_wheel`) with
cyclonedx-python-lib (CycloneDX 1.6 JSON). It is reproducible like the wheel around it: its time is the
wheel's stamp (the commit time or ``SOURCE_DATE_EPOCH``), its serial number is derived from the wheel's
name, version and commit, and every list in it is sorted; nothing names the machine or the checkout's path.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata

from cyclonedx.model import HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output import make_outputter
from cyclonedx.schema import OutputFormat, SchemaVersion
from packageurl import PackageURL

from kiln.core.fsutil import digest
from kiln.tasks.project.config import Variant
from kiln.tasks.wheel.stored import ResultCache

#: Where PEP 770 puts SBOMs inside a wheel, below its ``.dist-info`` directory.
SBOM_DIR = "sboms"
SBOM_NAME = "kiln.cdx.json"
#: Members that are compiled code: shared libraries and device code (cubin, hsaco, PTX, fat binaries).
BINARY_SUFFIXES = (".so", ".pyd", ".dylib", ".cubin", ".hsaco", ".ptx", ".fatbin")
_FORMAT = "kiln-sbom-1"  # bump when the document made of the same inputs changes
_BATCH = "sbom"
_SERIAL_NAMESPACE = uuid.UUID("6f0b7c55-5d0e-4b7e-9a53-3a8f3c1f0b6e")  # Kiln's: serial numbers are uuid5 in it


def is_binary(arcname: str) -> bool:
    name = arcname.rsplit("/", 1)[-1]
    return name.endswith(BINARY_SUFFIXES) or ".so." in name  # libfoo.so.1 too


def sbom_arcname(dist_info: str) -> str:
    return f"{dist_info}/{SBOM_DIR}/{SBOM_NAME}"


def _tool(name: str, version: str) -> Component:
    purl = PackageURL(type="pypi", name=name, version=version) if name in ("triton", "torch") else None
    return Component(name=name, version=version, type=ComponentType.APPLICATION, purl=purl)


def _binary(arcname: str, sha256: str, size: int) -> Component:
    hashed = HashType(alg=HashAlgorithm.SHA_256, content=sha256)
    return Component(name=arcname, type=ComponentType.FILE, hashes=[hashed],
                     bom_ref=f"file:{arcname}", properties=[Property(name="kiln:size", value=str(size))])


def wheel_sbom(distribution: str, version: str, variant: Variant, commit: str, epoch: int,
               toolchain: Sequence[tuple[str, str]], members: Sequence[tuple[str, bytes]],
               cache: ResultCache | None = None) -> bytes:
    """The SBOM of a wheel of ``distribution`` ``version`` built for ``variant`` from ``commit``.

    ``toolchain``: (tool, version) pairs the binaries were compiled with (nvcc, Triton, torch);
    ``members``: the wheel's (arcname, bytes), of which every binary is listed with its sha256.
    ``cache``: the build cache, which keeps each SBOM by everything it is made of (:func:`sbom_key`), so a
    warm build reads it back instead of building and serialising the document again (a third of a
    warm wheel's own work).
    """
    binaries = sorted((arcname, hashlib.sha256(data).hexdigest(), len(data)) for arcname, data in members
                      if is_binary(arcname))
    key = sbom_key(distribution, version, variant, commit, epoch, toolchain, binaries)
    stored = None if cache is None else cache.file(_BATCH, key, SBOM_NAME)
    if stored is not None:
        return stored
    document = _document(distribution, version, variant, commit, epoch, toolchain, binaries)
    if cache is not None:
        cache.put(_BATCH, key, {SBOM_NAME: document}, {"kind": "sbom"})
    return document


def sbom_key(distribution: str, version: str, variant: Variant, commit: str, epoch: int,
             toolchain: Sequence[tuple[str, str]], binaries: Sequence[tuple[str, str, int]]) -> str:
    """Every input of the document: the writer's format and library, then each argument it reads."""
    return digest(_FORMAT, _cyclonedx_version(), distribution, version, variant.name, variant.backend,
                  *variant.archs, "\0", commit, str(epoch), *(f"{t}\0{v}" for t, v in sorted(toolchain)),
                  *(f"{name}\0{sha}\0{size}" for name, sha, size in binaries))


@functools.cache
def _cyclonedx_version() -> str:
    return metadata.version("cyclonedx-python-lib")


def _document(distribution: str, version: str, variant: Variant, commit: str, epoch: int,
              toolchain: Sequence[tuple[str, str]], binaries: Sequence[tuple[str, str, int]]) -> bytes:
    subject = Component(name=distribution, version=version, type=ComponentType.LIBRARY,
                        bom_ref=f"pkg:pypi/{distribution}@{version}",
                        purl=PackageURL(type="pypi", name=distribution, version=version))
    properties = [Property(name="kiln:commit", value=commit or "none"),
                  Property(name="kiln:variant", value=variant.name),
                  Property(name="kiln:backend", value=variant.backend),
                  Property(name="kiln:archs", value=",".join(variant.archs) or "none")]
    bom = Bom(serial_number=uuid.uuid5(_SERIAL_NAMESPACE, f"{distribution}\0{version}\0{commit}"),
              properties=properties)
    bom.metadata.timestamp = datetime.fromtimestamp(epoch, UTC)
    bom.metadata.component = subject
    for name, tool_version in sorted(toolchain):
        if tool_version != "absent":  # a tool this build did not have (aot.toolchain_versions) built nothing
            bom.metadata.tools.components.add(_tool(name, tool_version))
    components = [_binary(arcname, sha, size) for arcname, sha, size in binaries]
    for component in components:
        bom.components.add(component)
    bom.register_dependency(subject, components)
    text = make_outputter(bom, OutputFormat.JSON, SchemaVersion.V1_6).output_as_string(indent=2)
    return (text + "\n").encode()
