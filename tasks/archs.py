"""GPU arch names: parsing and validation (pure).

CUDA archs are ``major.minor`` with an optional ``a``/``f`` suffix and an
optional ``+PTX`` (``"9.0a"``, ``"8.0+PTX"``); ROCm archs are ``gfx`` names.
``native`` is refused: a CI machine's own GPU says nothing about users'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from release.errors import InvalidInputError

_CUDA = re.compile(r"^(?P<major>[1-9][0-9]?)\.(?P<minor>[0-9])(?P<suffix>[af]?)(?P<ptx>\+PTX)?$")
_ROCM = re.compile(r"^gfx[0-9]{2,3}[0-9a-f]$")


@dataclass(frozen=True, order=True)
class CudaArch:
    major: int
    minor: int
    suffix: Literal["", "a", "f"] = ""
    ptx: bool = False

    @property
    def base(self) -> "CudaArch":
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
    if name.strip().lower() == "native":
        raise InvalidInputError("arch 'native' is refused: name the gfx archs to build explicitly (e.g. 'gfx942')")
    if not _ROCM.match(name.strip()):
        raise InvalidInputError(f"unknown ROCm arch {name!r}: expected a gfx name such as 'gfx90a' or 'gfx942'")
    return name.strip()


def validate_arch(name: str, backend: str) -> str:
    """Return the canonical spelling of ``name`` for ``backend`` or raise."""
    if backend == "cuda":
        return str(parse_cuda_arch(name))
    if backend == "hip":
        return parse_rocm_arch(name)
    raise InvalidInputError(f"backend {backend!r} takes no archs, got {name!r}")
