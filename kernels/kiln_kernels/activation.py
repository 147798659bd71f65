"""``silu_and_mul``: the CUDA C++ kernel from ``kernels/csrc/``, registered with
torch as ``torch.ops.kiln_csrc.silu_and_mul``.

The shared library is a torch extension built by the pipeline's nvcc stage
for the variant's filtered archs (``kiln.toml``: ``[build.toolchain] torch =
true``) and shipped as ``kiln_kernels/_aot/libkiln_csrc.so`` (a developer build
may sit in ``kiln_kernels/csrc/``); :func:`load_library` loads it with
``torch.ops.load_library``. It raises :class:`KernelUnavailableError` — never
crashes — when there is no loadable library; the op falls back to the torch
reference then, or without a CUDA GPU, saying so once.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Literal

import torch

from kiln_kernels.errors import KernelUnavailableError
from kiln_kernels.platform import Platform, Settings, current_platform, current_settings, note_path

KERNEL = "silu_and_mul"
LIBRARY = "libkiln_csrc.so"
ABI_VERSION = 2
SOURCES = ("csrc/silu_and_mul.cu", "csrc/ops.cpp")
SUPPORTED_CUDA = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
_PKG = Path(__file__).resolve().parent
SEARCH = (_PKG / "_aot" / LIBRARY, _PKG / "csrc" / LIBRARY)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ActivationPath = Literal["csrc", "reference"]
_log = logging.getLogger(__name__)


def activation_path(platform: Platform, settings: Settings, library_loads: bool) -> ActivationPath:
    """Which implementation runs (pure): CUDA only, and only with the library."""
    if settings.allows(KERNEL) and platform.backend == "cuda" and library_loads:
        return "csrc"
    return "reference"


def load_library(path: Path | None = None) -> Path:
    """Load the csrc library into torch (``torch.ops.kiln_csrc``); its path, or
    :class:`KernelUnavailableError` saying why not. Needs no GPU: the ops only run on one."""
    if torch.version.hip:
        raise KernelUnavailableError(f"{LIBRARY}: built for NVIDIA GPUs only; this torch is a ROCm build")
    candidates = (path,) if path is not None else SEARCH
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise KernelUnavailableError(
            f"{LIBRARY} not found (looked in {', '.join(map(str, candidates))}); "
            "build it with the pipeline's nvcc stage or benchmarks/gpu_check.sh"
        )
    try:
        torch.ops.load_library(str(found))
        version = torch.ops.kiln_csrc.abi_version()
    except (OSError, RuntimeError, AttributeError) as exc:
        raise KernelUnavailableError(f"{found}: cannot load the library into torch: {exc}") from exc
    if version != ABI_VERSION:
        raise KernelUnavailableError(f"{found}: ABI version {version}, expected {ABI_VERSION}; rebuild it")
    return found


@functools.cache
def _library() -> Path | None:
    try:
        if not torch.cuda.is_available():
            raise KernelUnavailableError(
                f"{LIBRARY}: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                "the csrc kernels need an NVIDIA GPU — the torch reference is used instead")
        return load_library()
    except KernelUnavailableError as exc:
        _log.warning("silu_and_mul falls back to the torch reference: %s", exc)
        return None


def reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _csrc(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln_csrc.silu_and_mul(x)


@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def _op(x: torch.Tensor) -> torch.Tensor:
    platform = current_platform(x.device)
    lib = _library() if platform.backend == "cuda" else None
    path = activation_path(platform, current_settings(), lib is not None)
    note_path(KERNEL, path)
    if path == "csrc":
        return _csrc(x.contiguous())
    return reference(x)


@_op.register_fake
def _fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``(M, 2D)`` -> ``(M, D)``: ``silu(x[:, :D]) * x[:, D:]``, float math."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul expects (M, 2D), got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"silu_and_mul: dtype {x.dtype} is not float32/float16/bfloat16")
    return torch.ops.kiln.silu_and_mul(x)
