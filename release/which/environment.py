"""The environment ``kiln which`` looks for a wheel for: each axis as given, else the running one's.

Parsed here, once, into a :class:`kiln.release.which.pick.Environment`: ``--python 3.12`` (else this
interpreter, with :func:`packaging.tags.sys_tags`), ``--platform manylinux_2_28_x86_64`` (every older
manylinux of that arch is accepted too, as a manylinux system accepts them; else this machine's platforms),
``--torch 2.14.1``, ``--cuda 13.0`` / ``--rocm 6.4`` and ``--arch 9.0`` (else what the installed torch says:
its version, ``torch.version.cuda`` or ``.hip``, the visible GPU's capability; none without torch). ``none``
states an axis is absent. A bad value is an :class:`~kiln.core.errors.InvalidInputError` naming it.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any

from packaging import tags
from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError
from kiln.release.which.pick import Backend, Environment

log = logging.getLogger(__name__)

NONE = "none"
_MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)")
_LEGACY = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
_ARCH = re.compile(r"\d+\.\d+[af]?")


@dataclass(frozen=True)
class Asked:
    """The axes as the command line gives them (None: the running environment's)."""

    python: str | None = None
    platform: str | None = None
    torch: str | None = None
    cuda: str | None = None
    rocm: str | None = None
    arch: str | None = None


def _version(flag: str, value: str) -> Version:
    try:
        return Version(value)
    except InvalidVersion as exc:
        raise InvalidInputError(f"{flag} {value!r} is not a version (e.g. {flag} 3.12)") from exc


def platforms(platform: str) -> list[str]:
    """``manylinux_2_28_x86_64`` and every manylinux below it (and ``linux_x86_64``), newest first."""
    if not platform or "-" in platform or " " in platform:
        raise InvalidInputError(f"--platform {platform!r} is not a wheel platform tag (e.g. manylinux_2_28_x86_64)")
    found = _MANYLINUX.fullmatch(platform)
    if found is None:
        return [platform]
    major, minor, arch = int(found.group(1)), int(found.group(2)), found.group(3)
    expanded = []
    for m in range(minor, 4, -1):
        expanded.append(f"manylinux_{major}_{m}_{arch}")
        if (major, m) in _LEGACY:
            expanded.append(f"{_LEGACY[(major, m)]}_{arch}")
    return [*expanded, f"linux_{arch}"]


def _tags(python: Version | None, platform: str | None) -> tuple[tags.Tag, ...]:
    if python is None and platform is None:
        return tuple(tags.sys_tags())
    version = (python.major, python.minor) if python is not None else sys.version_info[:2]
    plats = platforms(platform) if platform is not None else list(tags.platform_tags())
    return (*tags.cpython_tags(version, platforms=plats), *tags.compatible_tags(version, platforms=plats))


def _torch_module() -> Any | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _running_backend(torch: Any | None) -> Backend:
    if torch is not None and getattr(torch.version, "cuda", None):
        return Backend("cuda", Version(torch.version.cuda))
    if torch is not None and getattr(torch.version, "hip", None):
        return Backend("hip", Version(Version(torch.version.hip.split("-")[0]).base_version))
    return Backend("cpu")


def _running_arch(torch: Any | None) -> str | None:
    if torch is None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def _backend(asked: Asked, torch: Any | None) -> Backend:
    if asked.cuda is not None and asked.rocm is not None and NONE not in (asked.cuda, asked.rocm):
        raise InvalidInputError(f"--cuda {asked.cuda} and --rocm {asked.rocm}: give one backend")
    for flag, kind, value in (("--cuda", "cuda", asked.cuda), ("--rocm", "hip", asked.rocm)):
        if value is not None and value != NONE:
            return Backend(kind, _version(flag, value))  # type: ignore[arg-type]
    if NONE in (asked.cuda, asked.rocm):
        return Backend("cpu")
    return _running_backend(torch)


def environment(asked: Asked) -> Environment:
    """The environment to match: what ``asked`` says, the rest read from this interpreter and its torch."""
    python = _version("--python", asked.python) if asked.python is not None else None
    needs_torch = asked.torch is None or (asked.cuda is None and asked.rocm is None) or asked.arch is None
    torch = _torch_module() if needs_torch else None  # importing torch takes seconds: only for an axis not given
    if asked.torch is not None:
        torch_version = None if asked.torch == NONE else _version("--torch", asked.torch)
    else:
        torch_version = Version(torch.__version__) if torch is not None else None
    if asked.arch is not None and asked.arch != NONE and not _ARCH.fullmatch(asked.arch):
        raise InvalidInputError(f"--arch {asked.arch!r} is not a GPU arch (e.g. --arch 9.0)")
    arch = (None if asked.arch == NONE else asked.arch) if asked.arch is not None else _running_arch(torch)
    running = Version(".".join(map(str, sys.version_info[:3])))
    return Environment(python=python or running, tags=_tags(python, asked.platform), torch=torch_version,
                       backend=_backend(asked, torch), arch=arch)
