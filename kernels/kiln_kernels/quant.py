"""``per_token_quant``: row-wise dynamic quantization to int8 or fp8 (e4m3).

``scale = max(|row|, EPS) / qmax`` and ``q = clamp(round(x / scale))``.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from kiln_kernels import _launch
from kiln_kernels.platform import Platform, Settings, current_platform, current_settings, note_path

KERNEL = "per_token_quant"
EPS = 1e-10
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCKS = (512, 2048)  # the registry compiles exactly these ahead of time

QuantPath = Literal["triton", "reference"]
_log = logging.getLogger(__name__)


def quant_path(platform: Platform, settings: Settings, out_dtype: torch.dtype) -> QuantPath:
    """Which implementation runs. fp8 needs sm_89+ or gfx942+; the Triton
    interpreter's fp8 conversion flushes subnormals, so fp8 never takes the
    fast path there."""
    if not settings.allows(KERNEL) or not platform.runs_triton:
        return "reference"
    if out_dtype == torch.float8_e4m3fn:
        if platform.backend == "cpu" or not (
            platform.cuda_at_least("8.9") or platform.hip_at_least("gfx942")
        ):
            return "reference"
    return "triton"


def block_for(n: int) -> int:
    return BLOCKS[0] if n <= BLOCKS[0] else BLOCKS[1]


def spec_name(x_dtype: torch.dtype, out_dtype: torch.dtype, block: int) -> str:
    out = "i8" if out_dtype == torch.int8 else "fp8"
    return f"{_launch.short(x_dtype)}_{out}_b{block}"


def reference(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation; also the fallback path."""
    qmax = QMAX[dtype]
    xf = x.float()
    if x.shape[1] == 0:  # amax over an empty row is an error; the kernel's max is 0
        return x.new_empty(x.shape, dtype=dtype), xf.new_full((x.shape[0], 1), EPS / qmax)
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(EPS) / qmax
    y = (xf / scale).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def _triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln_kernels import _quant_tl

    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = block_for(n)
    consts = {"BLOCK": block, "EPS": EPS, "QMAX": QMAX[dtype], "IS_INT": dtype == torch.int8}
    _launch.launch(
        KERNEL, "per_token_quant_kernel", spec_name(x.dtype, dtype, block),
        _quant_tl.per_token_quant_kernel, (m,),
        (x, q, scale, n, x.stride(0), q.stride(0)), consts, x.device,
        num_warps=4 if block == BLOCKS[0] else 8,
    )
    return q, scale


@torch.library.custom_op("kiln::per_token_quant", mutates_args=())
def _op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    path = quant_path(current_platform(x.device), current_settings(), dtype)
    note_path(KERNEL, path)
    if path == "triton":
        return _triton(x if x.stride(1) == 1 else x.contiguous(), dtype)
    return reference(x, dtype)


@_op.register_fake
def _fake(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    return x.new_empty((m, n), dtype=dtype), x.new_empty((m, 1), dtype=torch.float32)


def per_token_quant(
    x: torch.Tensor, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D float tensor; returns ``(q, scale)`` with
    ``scale`` float32 of shape ``(M, 1)`` and ``q.float() * scale ≈ x``."""
    if x.dim() != 2:
        raise ValueError(f"per_token_quant expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"per_token_quant: input dtype {x.dtype} is not float32/float16/bfloat16")
    if dtype not in QMAX:
        raise TypeError(f"per_token_quant: output dtype {dtype} is not torch.int8/torch.float8_e4m3fn")
    return torch.ops.kiln.per_token_quant(x, dtype)
