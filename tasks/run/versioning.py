"""Wheel versions: nightly dev releases and the variant as a PEP 440 local label."""

from __future__ import annotations

import re
import time

from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError

# PEP 440 local labels: alphanumerics separated by dots; packaging normalises
# the rest, so a name it would rewrite is refused rather than silently changed.
_LOCAL = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")


def _parse(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise InvalidInputError(f"version {version!r} is not a PEP 440 version (e.g. '0.1.0')") from None


def check_build_version(version: str) -> str:
    """``version`` if it is a public PEP 440 version a variant label can be added to."""
    if _parse(version).local:
        raise InvalidInputError(f"version {version!r} already has a local part; the variant adds it")
    return version


def nightly_version(base: str, commit_time: int | None) -> str:
    """``("0.1.0", <2026-11-29 21:07:03 UTC>)`` -> ``"0.1.0.dev20261129210703"``.

    The dev number is the commit's time: rebuilding a commit gives the same
    version, and later commits sort higher. ``None`` (no commit: not a git
    checkout) gives ``.dev0``, which such a run can never publish.
    """
    parsed = _parse(base)
    if parsed.local or parsed.dev is not None:
        raise InvalidInputError(f"nightly base version {base!r} must have neither a .dev nor a +local part")
    stamp = "0" if commit_time is None else time.strftime("%Y%m%d%H%M%S", time.gmtime(commit_time))
    return str(Version(f"{parsed.public}.dev{stamp}"))


def variant_version(version: str, variant: str) -> str:
    """``("0.1.0.dev20261129", "cu130")`` -> ``"0.1.0.dev20261129+cu130"``."""
    parsed = _parse(version)
    if parsed.local:
        raise InvalidInputError(f"version {version!r} already has a local part; the variant adds it")
    if not _LOCAL.match(variant):
        raise InvalidInputError(
            f"variant name {variant!r} cannot be a PEP 440 local label (lowercase letters and digits)"
        )
    return str(Version(f"{parsed}+{variant}"))
