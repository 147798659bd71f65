"""The one rule for ordering GPU archs, shared by build time and run time (pure, no imports of kiln).

Kiln's planner decides with :func:`at_least` whether a specialization is built
for an arch (its ``min_arch``), and a kernel package decides with the same
function whether the artifact it shipped is meant for the device it runs on:
a second rule in either place would build artifacts nobody loads, or load
none that were built.

CUDA archs are ``major.minor`` with an optional ``a``/``f`` suffix and an
optional ``+PTX`` (``"9.0a"``, ``"12.0+PTX"``); neither changes the order.
ROCm archs are gfx names: ``gfx`` + the gfx version, whose last two hex digits
are the minor version and the stepping and whose leading digits are the major
(``gfx90a`` = 9.0.10, ``gfx942`` = 9.4.2, ``gfx1151`` = 11.5.1), ordered by
(major, minor, stepping). Validation with Kiln's error types lives in
``kiln.tasks.project.archs``; this module raises ``ValueError``.
"""

from __future__ import annotations

import re
from typing import Literal

Backend = Literal["cuda", "hip"]

_CUDA = re.compile(r"^(?P<major>[0-9]+)(?:\.(?P<minor>[0-9]+))?(?P<suffix>[af]?)(?P<ptx>\+PTX)?$")
_GFX = re.compile(r"^gfx(?P<major>[0-9]{1,2})(?P<minor>[0-9a-f])(?P<stepping>[0-9a-f])$")


def cuda_arch_key(arch: str) -> tuple[int, int]:
    """``"9.0a"`` -> ``(9, 0)``, ``"12.0+PTX"`` -> ``(12, 0)``, ``"12"`` -> ``(12, 0)``."""
    match = _CUDA.match(arch.strip())
    if not match:
        raise ValueError(f"not a CUDA arch: {arch!r} (expected e.g. '9.0', '9.0a' or '12.0+PTX')")
    return int(match["major"]), int(match["minor"] or 0)


def gfx_version(arch: str) -> tuple[int, int, int]:
    """``"gfx90a"`` -> ``(9, 0, 10)``, ``"gfx942"`` -> ``(9, 4, 2)``, ``"gfx1151"`` -> ``(11, 5, 1)``."""
    match = _GFX.match(arch.strip().lower())
    if not match:
        raise ValueError(f"not a gfx arch: {arch!r} (expected e.g. 'gfx90a', 'gfx942' or 'gfx1100')")
    return int(match["major"]), int(match["minor"], 16), int(match["stepping"], 16)


def arch_key(backend: str, arch: str) -> tuple[int, ...]:
    """The sort key of ``arch`` on ``backend``: archs compare as their keys do."""
    if backend == "cuda":
        return cuda_arch_key(arch)
    if backend == "hip":
        return gfx_version(arch)
    raise ValueError(f"backend {backend!r} has no archs (expected 'cuda' or 'hip')")


def at_least(backend: str, arch: str, minimum: str) -> bool:
    """True when ``arch`` is ``minimum`` or a newer arch of ``backend``."""
    return arch_key(backend, arch) >= arch_key(backend, minimum)
