"""What the current machine can run, and what the user allowed.

Every fast path is double-gated: the *platform* must support it and the
*settings* must not disable it. Both are frozen values passed into pure
eligibility functions, so tests can hand in a CUDA or ROCm platform on a CPU
machine. The environment is parsed once here (``Settings.from_env``) and
nowhere deeper.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch.torch_version import TorchVersion

# cuda_arch_key stays importable from here: it is this package's public name for the shared parse.
from kiln.runtime.archs import at_least, cuda_arch_key  # noqa: F401
from kiln.runtime.loader import triton_version

Backend = Literal["cuda", "hip", "cpu"]

_log = logging.getLogger(__name__)
_TRUE = frozenset({"1", "true", "yes", "on"})

# CDNA archs in capability order; RDNA parts are not supported targets.
HIP_ARCHS: tuple[str, ...] = ("gfx90a", "gfx942", "gfx950")


@dataclass(frozen=True)
class Platform:
    """The hardware and software a kernel call would run on.

    ``arch`` is ``"major.minor"`` on CUDA, a ``gfx`` name on ROCm and ``""`` on
    the CPU. ``interpreter`` is true when Triton kernels run through the Triton
    interpreter (``TRITON_INTERPRET=1``); ``triton_version`` is ``None`` when
    Triton is not importable.
    """

    backend: Backend
    arch: str = ""
    interpreter: bool = False
    torch_version: str = str(torch.__version__)
    triton_version: str | None = None

    def cuda_at_least(self, arch: str) -> bool:
        """True on CUDA when this arch is ``arch`` or newer."""
        return self.backend == "cuda" and at_least("cuda", self.arch, arch)

    def hip_at_least(self, arch: str) -> bool:
        """True on a supported ROCm arch (see :data:`HIP_ARCHS`) at or above ``arch``."""
        return self.backend == "hip" and self.arch in HIP_ARCHS and at_least("hip", self.arch, arch)

    def torch_at_least(self, version: str) -> bool:
        return TorchVersion(self.torch_version) >= version

    @property
    def runs_triton(self) -> bool:
        """Whether Triton kernels can run at all: a GPU Triton targets, or the
        interpreter on the CPU."""
        if self.triton_version is None:
            return False
        if self.backend == "cpu":
            return self.interpreter
        return self.cuda_at_least("8.0") or self.hip_at_least("gfx90a")


@dataclass(frozen=True)
class Settings:
    """User switches. ``disabled`` holds kernel names whose fast path is off
    (``KILN_DISABLE_<KERNEL>=1``, e.g. ``KILN_DISABLE_ROUTER_LOGITS=1``)."""

    disabled: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        prefix = "KILN_DISABLE_"
        off = {
            key[len(prefix):].lower()
            for key, value in environ.items()
            if key.startswith(prefix) and value.strip().lower() in _TRUE
        }
        return cls(disabled=frozenset(off))

    def allows(self, kernel: str) -> bool:
        return kernel not in self.disabled and "all" not in self.disabled


@functools.cache
def _detect(device: torch.device) -> Platform:
    interpreter = os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
    base = {"interpreter": interpreter, "triton_version": triton_version()}
    if device.type != "cuda":
        return Platform(backend="cpu", **base)
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return Platform(backend="hip", arch=props.gcnArchName.split(":")[0], **base)
    return Platform(backend="cuda", arch=f"{props.major}.{props.minor}", **base)


def current_platform(device: torch.device | str | None = None) -> Platform:
    """The platform for ``device`` (default: the current CUDA device if any).

    Cached per device: the per-call cost is a dict lookup, never a sync.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _detect(device)


@functools.cache
def current_settings() -> Settings:
    return Settings.from_env(os.environ)


def reset() -> None:
    """Forget the cached platform and settings (after changing the environment)."""
    _detect.cache_clear()
    current_settings.cache_clear()


# --- which path ran ------------------------------------------------------------

_recorders: list[list[tuple[str, str]]] = []


@contextmanager
def record_paths() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(kernel, path)`` for every op call inside the block, so a test
    can assert which implementation actually ran."""
    seen: list[tuple[str, str]] = []
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def note_path(kernel: str, path: str) -> None:
    for seen in _recorders:
        seen.append((kernel, path))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s: %s path", kernel, path)
