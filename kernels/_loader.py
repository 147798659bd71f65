"""Find and load the precompiled Triton artifacts a wheel ships.

The build stage writes ``kernels/_aot/manifest.json``: a JSON list of
``{kernel, entry, specialization, arch, kind, path, sha256}`` with ``path``
relative to ``kernels/_aot/``. A source checkout has no manifest; then, or
when nothing matches the device, ops use Triton's JIT and say so once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kernels.platform import Platform, cuda_arch_key

AOT_DIR = Path(__file__).resolve().parent / "_aot"
_KEYS = ("kernel", "entry", "specialization", "arch", "kind", "path", "sha256")
_log = logging.getLogger("kiln.kernels.loader")


@dataclass(frozen=True)
class Artifact:
    kernel: str
    entry: str
    specialization: str
    arch: str
    kind: str  # "cubin" | "hsaco"
    path: Path  # absolute
    sha256: str
    triton: str | None = None  # the Triton version that built it, when the manifest says


def parse_manifest(data: Any, root: Path) -> tuple[Artifact, ...]:
    """Validate a decoded manifest; paths must stay inside ``root``."""
    if not isinstance(data, list):
        raise ValueError("AOT manifest must be a JSON list of entries")
    out = []
    for i, entry in enumerate(data):
        missing = [k for k in _KEYS if not isinstance(entry, dict) or not isinstance(entry.get(k), str)]
        if missing:
            raise ValueError(f"AOT manifest entry {i}: missing or non-string {missing}")
        path = (root / entry["path"]).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"AOT manifest entry {i}: path {entry['path']!r} leaves {root}")
        toolchain = entry.get("toolchain") if isinstance(entry.get("toolchain"), dict) else {}
        out.append(Artifact(**{k: entry[k] for k in _KEYS if k != "path"}, path=path,
                            triton=toolchain.get("triton")))
    return tuple(out)


_root: list[Path] = [AOT_DIR]  # one slot; replaced by use_root()


def use_root(root: Path) -> None:
    """Read artifacts from ``root`` instead of the package's ``_aot/`` (self
    checks build a manifest in a scratch directory), forgetting what was loaded."""
    _root[0] = root
    manifest.cache_clear()
    _compiled.clear()
    _warned.clear()


@functools.cache
def manifest(root: Path | None = None) -> tuple[Artifact, ...]:
    root = root or _root[0]
    file = root / "manifest.json"
    if not file.is_file():
        return ()
    return parse_manifest(json.loads(file.read_text()), root)


def _arch_rank(platform: Platform, arch: str) -> tuple[int, int] | None:
    """How well an artifact arch fits the device; ``None`` when it cannot run.
    CUDA: the exact arch, else the highest lower minor of the same major (an
    ``a``-suffixed cubin runs only on its own arch). ROCm: exact only."""
    if platform.backend == "hip":
        return (0, 0) if arch == platform.arch else None
    want, have = cuda_arch_key(platform.arch), cuda_arch_key(arch)
    if have == want:
        return (1, 0 if arch.endswith("a") else 1)
    if have[0] == want[0] and have[1] < want[1] and not arch.endswith(("a", "f")):
        return (0, have[1])
    return None


def find_artifact(
    artifacts: tuple[Artifact, ...], kernel: str, entry: str, specialization: str, platform: Platform
) -> Artifact | None:
    """The best artifact for this device, or ``None`` (pure)."""
    kind = {"cuda": "cubin", "hip": "hsaco"}.get(platform.backend)
    best: tuple[tuple[int, int], Artifact] | None = None
    for art in artifacts:
        if (art.kernel, art.entry, art.specialization, art.kind) != (kernel, entry, specialization, kind):
            continue
        rank = _arch_rank(platform, art.arch)
        if rank is not None and (best is None or rank > best[0]):
            best = (rank, art)
    return None if best is None else best[1]


def artifact_path(kernel: str, entry: str, specialization: str, platform: Platform) -> Path | None:
    """Path of the shipped binary for this device, or ``None``."""
    art = find_artifact(manifest(), kernel, entry, specialization, platform)
    return None if art is None else art.path


class Precompiled(NamedTuple):
    """A launchable artifact and the argument positions it assumes divisible by 16."""

    kernel: Any  # triton CompiledKernel
    aligned: tuple[int, ...]


_compiled: dict[tuple, Precompiled | None] = {}
_warned: set[str] = set()


def _warn_once(kernel: str, message: str, *args: Any) -> None:
    if kernel not in _warned:
        _warned.add(kernel)
        _log.warning(message, *args)


def aot_kernel(kernel: str, entry: str, specialization: str, platform: Platform) -> Precompiled | None:
    """A launchable precompiled kernel, or ``None`` (then the caller JITs).

    Resolved once per key. A binary whose hash differs from the manifest is
    never launched."""
    key = (kernel, entry, specialization, platform)
    if key in _compiled:
        return _compiled[key]
    art = find_artifact(manifest(), kernel, entry, specialization, platform)
    result = None
    if art is None:
        _warn_once(kernel, "%s: no precompiled %s for %s %s; using Triton JIT",
                   kernel, specialization, platform.backend, platform.arch)
    elif art.triton is not None and art.triton != platform.triton_version:
        # A Triton binary's calling convention belongs to the Triton that built it.
        _warn_once(kernel, "%s: artifacts were built with Triton %s, this is Triton %s; using Triton JIT",
                   kernel, art.triton, platform.triton_version)
    elif not art.path.is_file():
        _warn_once(kernel, "%s: %s is listed in the manifest but missing; using Triton JIT", kernel, art.path)
    elif hashlib.sha256(art.path.read_bytes()).hexdigest() != art.sha256:
        _warn_once(kernel, "%s: %s does not match its manifest sha256; using Triton JIT", kernel, art.path)
    else:
        from kernels import aot, registry

        spec, fn = registry.find_specialization(kernel, entry, specialization)
        names = list(fn.arg_names)
        result = Precompiled(aot.load_compiled(fn, spec, art.path), tuple(names.index(p) for p in spec.aligned))
    _compiled[key] = result
    return result
