"""Triton kernel for the MoE router GEMM with a float32 result.

Imported lazily; see ``_quant_tl`` for why kernels call no jit helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_logits_kernel(
    h_ptr, w_ptr, out_ptr, T, E, D,
    stride_ht, stride_hd, stride_we, stride_wd, stride_ot, stride_oe,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
):
    # logits[t, e] = sum_d h[t, d] * w[e, d], accumulated in float32 and
    # stored as float32: no bf16 rounding of the result. The weight is read
    # through its strides, so a staged (E, D) weight needs no transpose.
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    re = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rd = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + rd
        a = tl.load(
            h_ptr + rt[:, None] * stride_ht + dd[None, :] * stride_hd,
            mask=(rt[:, None] < T) & (dd[None, :] < D), other=0.0,
        )
        b = tl.load(
            w_ptr + re[None, :] * stride_we + dd[:, None] * stride_wd,
            mask=(re[None, :] < E) & (dd[:, None] < D), other=0.0,
        )
        if DOT_F32:
            # The interpreter computes bf16 wrongly; bf16 values are exact in
            # float32, so upcasting first gives the same product.
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(
        out_ptr + rt[:, None] * stride_ot + re[None, :] * stride_oe, acc,
        mask=(rt[:, None] < T) & (re[None, :] < E),
    )
