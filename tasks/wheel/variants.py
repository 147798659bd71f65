"""Variant wheels (PEP 825) beside each variant's ``+local`` wheel: one project page can then hold them all.

For every GPU variant the build's finished wheel (``tiny_kernels-0.1.0.dev…+cu130-py3-none-manylinux_2_5_x86_64.whl``)
is written again as ``tiny_kernels-0.1.0.dev…-py3-none-manylinux_2_5_x86_64-cu130.whl``: the same members (the
platform tag too: :mod:`kiln.tasks.wheel.manylinux`) under the
public version (no ``+local`` label), its SBOM made again for that version, and a ``*.dist-info/variant.json``
mapping the label (the variant's name) to properties from the variant's backend, toolkit and archs:

- ``cuda``: namespace ``nvidia``; ``cuda_version_lower_bound`` the CUDA of the toolkit that built it (nvcc's
  version, else the ``cuNNN`` variant name), ``sm_arch`` one ``<major><minor>_real`` per arch (and
  ``_virtual`` for a ``+PTX`` one): the names uv's vendored NVIDIA provider understands.
- ``hip``: namespace ``amd``, ``gfx_arch`` the gfx targets (the WheelNext AMD provider's names; uv 0.13
  vendors no AMD provider and skips the namespace, so it never chooses such a wheel: it falls back).

The CPU build (the first ``cpu``-backend variant) becomes the ``null`` variant, the one with no properties
that variant-aware installers choose when nothing else fits, and also a plain wheel of the public version
with no label: the default an installer that knows nothing of variants (pip) installs from the same page.
Every file carries the build's stamp, so two builds give identical bytes. The index-level
``{name}-{version}-variants.json`` is :func:`kiln.release.index.variants.merge_variants` of these wheels.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from packaging.version import Version

from kiln.core.errors import InvalidInputError
from kiln.core.wheels import renamed_member
from kiln.release.index.variants import NULL_LABEL, VARIANT_JSON, VARIANT_SCHEMA, dumps, variant_filename
from kiln.tasks.project.config import KilnConfig, Variant
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from kiln.tasks.wheel.rewheel import read_members
from kiln.tasks.wheel.sbom import sbom_arcname, wheel_sbom
from kiln.tasks.wheel.stored import ResultCache

_log = logging.getLogger(__name__)

#: backend -> (namespace, provider): the provider as PEP 850's ``providers`` table names it.
PROVIDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "cuda": ("nvidia", {"plugin-api": "nvidia_variant_provider.plugin:NvidiaVariantPlugin",
                        "requires": ["nvidia-variant-provider>=0.0.1,<1.0.0"]}),
    "hip": ("amd", {"plugin-api": "amd_variant_provider.plugin:AMDVariantPlugin",
                    "requires": ["amd-variant-provider>=0.0.1,<1.0.0"]}),
}
VARIANT_WHEELS_DIR = "variant-wheels"
_CU = re.compile(r"^cu(\d{2,3})$")  # cu130 -> 13.0, cu128 -> 12.8, cu92 -> 9.2
_CC = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def cuda_lower_bound(variant: Variant, toolchain: dict[str, str]) -> str | None:
    """``major.minor`` of the CUDA that built the variant: nvcc's version, else a ``cuNNN`` name, else None."""
    nvcc = toolchain.get("nvcc", "absent")
    if nvcc != "absent":
        release = Version(nvcc).release
        return f"{release[0]}.{release[1] if len(release) > 1 else 0}"
    match = _CU.match(variant.name)
    return f"{match.group(1)[:-1]}.{match.group(1)[-1]}" if match else None


def sm_arch_values(archs: tuple[str, ...]) -> list[str]:
    """``("8.0", "9.0a", "12.0+PTX")`` -> ``["80_real", "90a_real", "120_real", "120_virtual"]``.

    An ``a``/``f`` arch keeps its suffix: uv 0.13 matches none of those, so such an arch alone never selects
    the wheel (it is not claimed for the whole family it would not run on).
    """
    values = []
    for arch in archs:
        match = _CC.match(arch)
        if match is None:
            raise InvalidInputError(f"CUDA arch {arch!r} has no sm_arch variant value")
        major, minor, suffix, ptx = match.groups()
        values.append(f"{major}{minor}{suffix}_real")
        if ptx:
            values.append(f"{major}{minor}_virtual")
    return sorted(set(values), key=values.index)


def variant_properties(variant: Variant, toolchain: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """The variant's properties, ``{namespace: {feature: [values]}}``; empty for a CPU variant."""
    if variant.backend == "cuda":
        features = {}
        bound = cuda_lower_bound(variant, toolchain)
        if bound is not None:
            features["cuda_version_lower_bound"] = [bound]
        if variant.archs:
            features["sm_arch"] = sm_arch_values(variant.archs)
        return {"nvidia": features} if features else {}
    if variant.backend == "hip":
        return {"amd": {"gfx_arch": sorted(variant.archs)}} if variant.archs else {}
    return {}


def variant_label(config: KilnConfig, variant: Variant) -> str | None:
    """The variant's label: its name for a GPU variant, ``null`` for the first CPU one, None for no variant wheel."""
    if variant.backend == "cpu":
        first = next(v for v in config.variants if v.backend == "cpu")
        return NULL_LABEL if first.name == variant.name else None
    return variant.name


def build_header(config: KilnConfig) -> dict[str, Any] | None:
    """The build's shared part of every variant.json (schema, namespace priorities in ``[[variants]]`` order,
    providers); None when no variant has a GPU backend (nothing is variant about its wheels)."""
    order: list[str] = []
    providers: dict[str, Any] = {}
    for variant in config.variants:
        if variant.backend in PROVIDERS:
            namespace, provider = PROVIDERS[variant.backend]
            if namespace not in providers:
                order.append(namespace)
                providers[namespace] = provider
    if not order or config.build.kind == "triton-jit":
        return None
    return {"$schema": VARIANT_SCHEMA, "default-priorities": {"namespace": order}, "providers": providers}


def variant_json(config: KilnConfig, variant: Variant, toolchain: dict[str, str]) -> dict[str, Any] | None:
    """The ``variant.json`` of ``variant``'s variant wheel, or None when it gets none."""
    header, label = build_header(config), variant_label(config, variant)
    if header is None or label is None:
        return None
    properties = variant_properties(variant, toolchain)
    if label != NULL_LABEL and not properties:
        _log.warning("variant %s has no variant properties (no CUDA version, no archs): no variant wheel",
                     variant.name)
        return None
    return {**header, "variants": {label: properties}}


def _public(version: str) -> str:
    return Version(version).public


def _with_version(metadata: bytes, version: str, wheel: str) -> bytes:
    """METADATA with its one ``Version`` header line set to ``version``; every other byte kept."""
    head, sep, body = metadata.partition(b"\n\n")
    lines = head.split(b"\n")
    found = [i for i, line in enumerate(lines) if line.startswith(b"Version:")]
    if len(found) != 1:
        raise InvalidInputError(f"{wheel}: METADATA has {len(found)} Version headers, expected one")
    lines[found[0]] = f"Version: {version}".encode()
    return b"\n".join(lines) + sep + body


def public_members(config: KilnConfig, variant: Variant, built: Path, stamp: WheelStamp,
                   cache: ResultCache | None = None) -> tuple[str, str, list[tuple[str, bytes]]]:
    """(public version, dist-info directory, members) of ``built`` under its public version: the same members
    in the same order (RECORD and signatures left to the writer), METADATA's Version line and the SBOM made again."""
    dist_info, members = read_members(built)
    old = dist_info.removesuffix(".dist-info")
    version = _public(old.rsplit("-", 1)[1])
    new = f"{old.rsplit('-', 1)[0]}-{version}"
    out = {renamed_member(name, old, new): data for name, data in members.items()
           if not (name.startswith(f"{dist_info}/") and name.rsplit("/", 1)[-1] in ("RECORD", "RECORD.jws",
                                                                                    "RECORD.p7s"))}
    info = f"{new}.dist-info"
    out[f"{info}/METADATA"] = _with_version(out[f"{info}/METADATA"], version, built.name)
    contents = [(name, data) for name, data in out.items() if not name.startswith(f"{info}/")]
    if sbom_arcname(info) in out:
        out[sbom_arcname(info)] = wheel_sbom(config.project.distribution, version, variant, stamp.commit,
                                             stamp.epoch, stamp.toolchain, contents, cache)
    return version, info, list(out.items())


def write_variant_wheels(config: KilnConfig, variant: Variant, built: Path, out_dir: Path, stamp: WheelStamp,
                         cache: ResultCache | None = None) -> list[Path]:
    """``variant``'s variant wheel (and, for the null variant, the plain default wheel) from its finished
    ``built`` wheel, in ``out_dir``; none for a variant that gets no variant wheel."""
    document = variant_json(config, variant, dict(stamp.toolchain))
    if document is None:
        return []
    label = next(iter(document["variants"]))
    version, info, members = public_members(config, variant, built, stamp, cache)
    parts = built.name.split("-")  # name-version-py-abi-platform.whl: PEP 427, as Kiln's writers name it
    plain = "-".join([parts[0], version, *parts[2:]])
    written = [write_wheel(out_dir, variant_filename(plain, label), [*members, (f"{info}/{VARIANT_JSON}",
                                                                                 dumps(document))], stamp, cache)]
    if label == NULL_LABEL:
        written.append(write_wheel(out_dir, plain, members, stamp, cache))
    _log.info("wrote %s from %s", ", ".join(p.name for p in written), built.name)
    return written
