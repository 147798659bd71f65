"""Triton kernel for one gated delta-rule decode step over a slot pool.

Imported lazily; see ``_quant_tl`` for why kernels call no jit helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gated_delta_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr,
    S, H, K, V, scale,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sbeta_b, sbeta_h,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Program (b, h, j) owns columns j*BLOCK_V.. of state[slot, h]: the value
    # columns of the recurrence are independent, so no program reads what
    # another writes. A row whose slot is outside [0, S) (the padding id -1)
    # has every load and store masked off: it reads no slot, writes no slot,
    # and its output is exactly zero.
    b = tl.program_id(0)
    h = tl.program_id(1)
    rv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rk = tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + b)
    valid = (slot >= 0) & (slot < S)
    safe = tl.where(valid, slot, 0).to(tl.int64)
    # Limits rather than `& valid`: a scalar mask does not broadcast in the
    # interpreter. With an invalid row every k/q/g load is zero, so u, S and out are.
    mk = rk < tl.where(valid, K, 0)
    mv = rv < tl.where(valid, V, 0)
    kk = tl.load(k_ptr + b * sk_b + h * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
    qq = tl.load(q_ptr + b * sq_b + h * sq_h + rk, mask=mk, other=0.0).to(tl.float32) * scale
    gg = tl.load(g_ptr + b * sg_b + h * sg_h + rk, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + b * sv_b + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
    bt = tl.load(beta_ptr + b * sbeta_b + h * sbeta_h).to(tl.float32)
    tile = ((safe * H + h) * K + rk[:, None]) * V + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    st = tl.load(state_ptr + tile, mask=m2, other=0.0) * tl.exp(gg)[:, None]
    u = vv - tl.sum(st * kk[:, None], axis=0)
    st = st + bt * kk[:, None] * u[None, :]
    o = tl.sum(st * qq[:, None], axis=0)
    tl.store(state_ptr + tile, st, mask=m2)
    tl.store(out_ptr + (b * H + h) * V + rv, o.to(out_ptr.dtype.element_ty), mask=rv < V)
