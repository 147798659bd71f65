"""``router_logits``: MoE router logits ``hidden @ weight.T (+ bias)`` in float32.

The fused paths produce float32 straight from the bf16 inputs in one GEMM
(``torch.mm(..., out_dtype=float32)`` on CUDA, else the Triton kernel). A
bias always takes the unfused path: no fused path can drop it silently.
"""

from __future__ import annotations

from typing import Literal

import torch

from kiln_kernels import _launch
from kiln_kernels.platform import Platform, Settings, current_platform, current_settings, note_path

KERNEL = "router_logits"
# (BLOCK_T, BLOCK_E, BLOCK_D, num_warps): the registry compiles exactly these.
CONFIGS = ((16, 64, 64, 4), (64, 64, 64, 4))

RouterPath = Literal["fused_mm", "fused_triton", "unfused"]


def router_path(
    platform: Platform, settings: Settings, *, has_bias: bool,
    hidden_dtype: torch.dtype, weight_dtype: torch.dtype,
) -> RouterPath:
    """Which implementation runs (pure). ``torch.mm(out_dtype=)`` is used on
    CUDA with torch 2.9 or newer only (older releases lack or half-support
    the overload); ROCm and the interpreter use the Triton kernel."""
    if has_bias or not settings.allows(KERNEL):
        return "unfused"
    if hidden_dtype != torch.bfloat16 or weight_dtype != torch.bfloat16:
        return "unfused"
    if platform.cuda_at_least("8.0") and platform.torch_at_least("2.9"):
        return "fused_mm"
    return "fused_triton" if platform.runs_triton else "unfused"


def config_for(t: int) -> tuple[int, int, int, int]:
    return CONFIGS[0] if t <= CONFIGS[0][0] else CONFIGS[1]


def spec_name(config: tuple[int, int, int, int]) -> str:
    bt, be, bd, _ = config
    return f"bf16_t{bt}_e{be}_d{bd}"


def stage_router_weight(weight: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Once, at load time: the weight as a contiguous bf16 ``(E, D)`` tensor on
    ``device``, the layout every fused path reads without a copy."""
    if weight.dim() != 2:
        raise ValueError(f"router weight must be (E, D), got shape {tuple(weight.shape)}")
    return weight.detach().to(device=device or weight.device, dtype=torch.bfloat16).contiguous()


def reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 product of the inputs (plus bias); also the unfused path."""
    out = torch.mm(hidden.float(), weight.float().t())
    return out if bias is None else out + bias.float()


def _triton(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from kiln_kernels import _router_tl

    t, d = hidden.shape
    e = weight.shape[0]
    out = torch.empty((t, e), dtype=torch.float32, device=hidden.device)
    if t == 0 or e == 0:
        return out
    config = config_for(t)
    bt, be, bd, warps = config
    interp = current_platform(hidden.device).interpreter
    consts = {"BLOCK_T": bt, "BLOCK_E": be, "BLOCK_D": bd, "DOT_F32": interp}
    grid = (_cdiv(t, bt), _cdiv(e, be))
    _launch.launch(
        KERNEL, "router_logits_kernel", spec_name(config), _router_tl.router_logits_kernel, grid,
        (hidden, weight, out, t, e, d, *hidden.stride(), *weight.stride(), *out.stride()),
        consts, hidden.device, num_warps=warps,
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("kiln::router_logits", mutates_args=())
def _op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    path = router_path(
        current_platform(hidden.device), current_settings(), has_bias=bias is not None,
        hidden_dtype=hidden.dtype, weight_dtype=weight.dtype,
    )
    note_path(KERNEL, path)
    if path == "fused_mm":
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    if path == "fused_triton":
        return _triton(hidden, weight)
    return reference(hidden, weight, bias)


@_op.register_fake
def _fake(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)


def router_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(T, D)`` bf16 hidden × ``(E, D)`` bf16 weight -> ``(T, E)`` float32 logits.
    Stage the weight once with :func:`stage_router_weight`."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"router_logits: hidden (T, D) and weight (E, D) must share D; got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"router_logits: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    return torch.ops.kiln.router_logits(hidden, weight, bias)
