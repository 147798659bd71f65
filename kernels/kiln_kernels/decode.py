"""``gated_delta_decode``: one decode step of the gated delta rule with
per-channel decay (KDA / gated DeltaNet), over states kept in a slot pool.

Per row ``b`` (slot ``s``) and head ``h``::

    S = exp(g)[:, None] * state[s, h]
    u = v - S.T @ k
    S = S + beta * outer(k, u)
    out = S.T @ (q * scale);  state[s, h] = S

Rows with ``slot_ids[b] == NULL_BLOCK_ID`` are padding: no slot is read or
written and their output is zero. Slot ids outside ``[0, S)`` are treated the
same way, so a bad id can never write out of bounds. Two live rows naming the
same slot are a caller error (the Triton path races on it).
"""

from __future__ import annotations

from typing import Literal

import torch

from kiln_kernels import _launch
from kiln_kernels.platform import Platform, Settings, current_platform, current_settings, note_path

KERNEL = "gated_delta_decode"
NULL_BLOCK_ID = -1
IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (BLOCK_K, BLOCK_V, num_warps): the registry compiles exactly these.
CONFIGS = ((64, 64, 4), (128, 64, 4))

DecodePath = Literal["triton", "reference"]


def decode_path(platform: Platform, settings: Settings) -> DecodePath:
    """Which implementation runs (pure)."""
    if settings.allows(KERNEL) and platform.runs_triton:
        return "triton"
    return "reference"


def config_for(k: int) -> tuple[int, int, int]:
    for config in CONFIGS:
        if k <= config[0]:
            return config
    block_k = 1 << (k - 1).bit_length()
    return (block_k, 32, 8)  # JIT only: no artifact is built for K > 128


def spec_name(dtype: torch.dtype, config: tuple[int, int, int]) -> str:
    return f"{_launch.short(dtype)}_k{config[0]}_v{config[1]}"


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slot_ids: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """The torch implementation and fallback path, free of host syncs.

    Rows are gathered and scattered with index ops. Every row that writes a
    given slot writes the same value (the owner row's new state, or the
    untouched old state for padding rows redirected there), so duplicate
    indices in ``index_copy_`` cannot make the result order-dependent."""
    n_slots, n_rows = state.shape[0], q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if n_slots == 0:  # every row is padding
        return q.new_zeros((n_rows, q.shape[1], v.shape[-1]))
    slots = slot_ids.long()
    valid = (slots >= 0) & (slots < n_slots)
    idx = torch.where(valid, slots, 0)
    old = state.index_select(0, idx)
    new = torch.exp(g.float()).unsqueeze(-1) * old
    u = v.float() - torch.einsum("bhkv,bhk->bhv", new, k.float())
    new = new + beta.float()[..., None, None] * k.float().unsqueeze(-1) * u.unsqueeze(-2)
    out = torch.einsum("bhkv,bhk->bhv", new, q.float() * scale)
    out = torch.where(valid[:, None, None], out, 0.0)  # not `* valid`: NaN * 0 is NaN
    rows = torch.arange(n_rows, device=q.device)
    owner = torch.full((n_slots + 1,), -1, dtype=torch.long, device=q.device)
    owner.scatter_reduce_(0, torch.where(valid, slots, n_slots), rows, reduce="amax")
    writer = owner[idx]
    value = torch.where((writer >= 0)[:, None, None, None], new[writer.clamp(min=0)], old)
    state.index_copy_(0, idx, value)
    return out.to(q.dtype)


def _triton(q, k, v, g, beta, state, slot_ids, scale: float) -> torch.Tensor:
    from kiln_kernels import _decode_tl

    n_rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty((n_rows, heads, dv), dtype=q.dtype, device=q.device)
    if n_rows == 0 or heads == 0:
        return out
    config = config_for(dk)
    block_k, block_v, warps = config
    grid = (n_rows, heads, -(-dv // block_v))
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *g.stride()[:2], *beta.stride())
    _launch.launch(
        KERNEL, "gated_delta_decode_kernel", spec_name(q.dtype, config),
        _decode_tl.gated_delta_decode_kernel, grid,
        (q, k, v, g, beta, state, slot_ids, out, state.shape[0], heads, dk, dv, float(scale), *strides),
        {"BLOCK_K": block_k, "BLOCK_V": block_v}, q.device, num_warps=warps,
    )
    return out


def _last_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("kiln::gated_delta_decode", mutates_args=("state",))
def _op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slot_ids: torch.Tensor, scale: float | None,
) -> torch.Tensor:
    path = decode_path(current_platform(q.device), current_settings())
    note_path(KERNEL, path)
    if path == "reference":
        return reference(q, k, v, g, beta, state, slot_ids, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g = (_last_dense(t) for t in (q, k, v, g))
    return _triton(q, k, v, g, beta, state, slot_ids, scale)


@_op.register_fake
def _fake(q, k, v, g, beta, state, slot_ids, scale):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


def gated_delta_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slot_ids: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """One decode step; updates ``state`` in place and returns ``out (B, H, V)``
    in the dtype of ``q``."""
    _check(q, k, v, g, beta, state, slot_ids)
    if scale is not None and not isinstance(scale, float):
        if isinstance(scale, torch.Tensor):  # float(tensor) would be a host sync
            raise TypeError("gated_delta_decode: scale must be a Python number, not a tensor")
        scale = float(scale)
    return torch.ops.kiln.gated_delta_decode(q, k, v, g, beta, state, slot_ids, scale)


def _check(q, k, v, g, beta, state, slot_ids) -> None:
    """Shape and dtype checks from metadata only (no sync)."""
    b, h, dk = q.shape
    dv = v.shape[-1]
    expected = {"k": (k, (b, h, dk)), "g": (g, (b, h, dk)), "v": (v, (b, h, dv)), "beta": (beta, (b, h))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"gated_delta_decode: {name} must be {shape}, got {tuple(t.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (h, dk, dv):
        raise ValueError(f"gated_delta_decode: state must be (S, {h}, {dk}, {dv}), got {tuple(state.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise TypeError("gated_delta_decode: state must be a contiguous float32 tensor")
    if slot_ids.shape != (b,) or slot_ids.dtype != torch.int32:
        raise TypeError(f"gated_delta_decode: slot_ids must be int32 of shape ({b},)")
    if q.dtype not in IN_DTYPES:
        raise TypeError(f"gated_delta_decode: dtype {q.dtype} is not float32/float16/bfloat16")
