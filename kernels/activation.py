"""``silu_and_mul``: the CUDA C++ kernel from ``kernels/csrc/``, called through
its C ABI with ctypes.

The shared library is built by the pipeline's nvcc stage and shipped as
``kernels/_aot/libkiln_csrc.so`` (a developer build may sit in
``kernels/csrc/``). :func:`load_library` raises :class:`KernelUnavailableError`
— never crashes — when there is no GPU or no loadable library; the op itself
falls back to the torch reference then, saying so once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Literal

import torch

from kernels.errors import KernelUnavailableError
from kernels.platform import Platform, Settings, current_platform, current_settings, note_path

KERNEL = "silu_and_mul"
LIBRARY = "libkiln_csrc.so"
ABI_VERSION = 1
SOURCES = ("csrc/silu_and_mul.cu",)
SUPPORTED_CUDA = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
_PKG = Path(__file__).resolve().parent
SEARCH = (_PKG / "_aot" / LIBRARY, _PKG / "csrc" / LIBRARY)
_SYMBOL = {torch.float32: "kiln_silu_and_mul_f32", torch.float16: "kiln_silu_and_mul_f16",
           torch.bfloat16: "kiln_silu_and_mul_bf16"}

ActivationPath = Literal["csrc", "reference"]
_log = logging.getLogger("kiln.kernels.activation")


def activation_path(platform: Platform, settings: Settings, library_loads: bool) -> ActivationPath:
    """Which implementation runs (pure): CUDA only, and only with the library."""
    if settings.allows(KERNEL) and platform.backend == "cuda" and library_loads:
        return "csrc"
    return "reference"


def load_library(path: Path | None = None) -> ctypes.CDLL:
    """Load the csrc library, or raise :class:`KernelUnavailableError` saying why."""
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            f"{LIBRARY}: no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "the csrc kernels need an NVIDIA GPU — the torch reference is used instead"
        )
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
        lib = ctypes.CDLL(str(found))
        version = lib.kiln_csrc_abi_version()
    except (OSError, AttributeError) as exc:
        raise KernelUnavailableError(f"{found}: cannot load the library: {exc}") from exc
    if version != ABI_VERSION:
        raise KernelUnavailableError(f"{found}: C ABI version {version}, expected {ABI_VERSION}; rebuild it")
    for symbol in _SYMBOL.values():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kiln_csrc_last_error.restype = ctypes.c_char_p
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        return load_library()
    except KernelUnavailableError as exc:
        _log.warning("silu_and_mul falls back to the torch reference: %s", exc)
        return None


def reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _csrc(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        rc = getattr(lib, _SYMBOL[x.dtype])(x.data_ptr(), out.data_ptr(), rows, d, stream)
    if rc != 0:
        raise RuntimeError(f"{_SYMBOL[x.dtype]} failed ({rc}): {lib.kiln_csrc_last_error().decode()}")
    return out


@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def _op(x: torch.Tensor) -> torch.Tensor:
    platform = current_platform(x.device)
    lib = _library() if platform.backend == "cuda" else None
    path = activation_path(platform, current_settings(), lib is not None)
    note_path(KERNEL, path)
    if path == "csrc":
        return _csrc(lib, x.contiguous())
    return reference(x)


@_op.register_fake
def _fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``(M, 2D)`` -> ``(M, D)``: ``silu(x[:, :D]) * x[:, D:]``, float math."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul expects (M, 2D), got shape {tuple(x.shape)}")
    if x.dtype not in _SYMBOL:
        raise TypeError(f"silu_and_mul: dtype {x.dtype} is not float32/float16/bfloat16")
    return torch.ops.kiln.silu_and_mul(x)
