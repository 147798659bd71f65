"""GPU arch names: parsing and validation (pure).

CUDA archs are ``major.minor`` with an optional ``a``/``f`` suffix and an
optional ``+PTX`` (``"9.0a"``, ``"8.0+PTX"``); ROCm archs are ``gfx`` names.
``native`` is refused: a CI machine's own GPU says nothing about users'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kiln.core.errors import InvalidInputError
from kiln.runtime.archs import gfx_version

_CUDA = re.compile(r"^(?P<major>[1-9][0-9]?)\.(?P<minor>[0-9])(?P<suffix>[af]?)(?P<ptx>\+PTX)?$")


@dataclass(frozen=True, order=True)
class CudaArch:
    major: int
    minor: int
    suffix: Literal["", "a", "f"] = ""
    ptx: bool = False

    @property
    def base(self) -> CudaArch:
        return CudaArch(self.major, self.minor)

    @property
    def sm(self) -> str:
        """``sm_90a`` style name used by nvcc's ``-gencode``."""
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def compute(self) -> str:
        return f"compute_{self.major}{self.minor}{self.suffix}"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")


def parse_cuda_arch(name: str) -> CudaArch:
    if name.strip().lower() == "native":
        raise InvalidInputError("arch 'native' is refused: name the archs to build explicitly (e.g. '9.0')")
    match = _CUDA.match(name.strip())
    if not match:
        raise InvalidInputError(
            f"unknown CUDA arch {name!r}: expected 'major.minor' with an optional 'a'/'f' suffix"
            " and optional '+PTX', e.g. '8.0', '9.0a', '10.0f', '12.0+PTX'"
        )
    return CudaArch(int(match["major"]), int(match["minor"]), match["suffix"], bool(match["ptx"]))  # type: ignore[arg-type]


def parse_rocm_arch(name: str) -> str:
    """A gfx target, decoded by the one generic rule (:func:`kiln.runtime.archs.gfx_version`), no table of names."""
    if name.strip().lower() == "native":
        raise InvalidInputError("arch 'native' is refused: name the gfx archs to build explicitly (e.g. 'gfx942')")
    try:
        gfx_version(name)
    except ValueError:
        raise InvalidInputError(f"unknown ROCm arch {name!r}: expected a gfx name such as 'gfx90a', 'gfx942'"
                                " or 'gfx1151'") from None
    return name.strip().lower()


def validate_arch(name: str, backend: str) -> str:
    """Return the canonical spelling of ``name`` for ``backend`` or raise."""
    if backend == "cuda":
        return str(parse_cuda_arch(name))
    if backend == "hip":
        return parse_rocm_arch(name)
    raise InvalidInputError(f"backend {backend!r} takes no archs, got {name!r}")


# --- resolution: requested archs ∩ a kernel's supported archs (pure) ---------

Rule = Literal["exact", "suffix", "lower-minor", "ptx"]


@dataclass(frozen=True)
class Resolved:
    """One build target of a kernel: ``arch`` is what gets compiled for ``requested``."""

    requested: str
    arch: str
    rule: Rule


def _resolve_cuda_one(target: CudaArch, supported: list[CudaArch]) -> tuple[CudaArch, Rule] | None:
    plain = [s for s in supported if not s.suffix]
    for arch in supported:
        if (arch.major, arch.minor, arch.suffix) == (target.major, target.minor, target.suffix):
            return arch, "exact"
    if not target.suffix:
        # An a/f build uses features of exactly that base arch: only when the base is asked for.
        suffixed = sorted((s for s in supported if s.suffix and s.base == target.base), key=lambda s: s.suffix)
        if suffixed:
            return suffixed[0], "suffix"
    lower = [s for s in plain if s.major == target.major and s.minor <= target.minor]
    if lower:
        return max(lower), "lower-minor"
    # PTX is forward-compatible: the driver JIT-compiles it on any newer arch.
    ptx = [s for s in plain if s.ptx and (s.major, s.minor) <= (target.major, target.minor)]
    if ptx:
        return max(ptx), "ptx"
    return None


def resolve_cuda(requested: Sequence[str], supported: Sequence[str]) -> tuple[Resolved, ...]:
    """Loose intersection for CUDA (docs/explanation/architecture.md, "Stages").

    Per requested arch: an exact match (suffix included); else, for a plain
    request, the kernel's ``a``/``f`` build of that same base arch; else the
    highest plain supported arch of the same major at or below it; else the
    highest ``+PTX`` entry at or below it. A requested ``+PTX`` carries over to
    the chosen arch. Targets that resolve to the same arch are built once.
    """
    wanted = [parse_cuda_arch(a) for a in requested]
    have = [parse_cuda_arch(a) for a in supported]
    out: dict[str, Resolved] = {}
    for target in wanted:
        found = _resolve_cuda_one(target, have)
        if found is None:
            continue
        arch, rule = found
        built = CudaArch(arch.major, arch.minor, arch.suffix, arch.ptx or target.ptx)
        key = str(built.base) + built.suffix
        previous = out.get(key)
        if previous is None or (built.ptx and "+PTX" not in previous.arch):
            out[key] = Resolved(str(target), str(built), rule)
    return tuple(sorted(out.values(), key=lambda r: parse_cuda_arch(r.arch)))


def resolve_rocm(requested: Sequence[str], supported: Sequence[str]) -> tuple[Resolved, ...]:
    """ROCm gfx names match exactly: code objects are not portable across gfx targets."""
    have = {parse_rocm_arch(a) for a in supported}
    return tuple(Resolved(a, a, "exact") for a in (parse_rocm_arch(r) for r in requested) if a in have)


def resolve(backend: str, requested: Sequence[str], supported: Sequence[str]) -> tuple[Resolved, ...]:
    if backend == "cuda":
        return resolve_cuda(requested, supported)
    if backend == "hip":
        return resolve_rocm(requested, supported)
    raise InvalidInputError(f"backend {backend!r} has no archs to resolve")


def skip_reason(kernel: str, backend: str, requested: Sequence[str], supported: Sequence[str]) -> str:
    return (
        f"kernel {kernel!r} skipped for {backend}: none of the requested archs {list(requested)}"
        f" is covered by its supported archs {list(supported)}"
    )
