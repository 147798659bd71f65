"""Triton kernel for row-wise dynamic quantization.

Imported lazily (first fast-path call, or the registry) so that
``TRITON_INTERPRET`` set by a test or a CPU user takes effect. Kernels here
call no other ``@triton.jit`` helper: the registry rebuilds plain
``JITFunction`` objects from ``.fn`` for ahead-of-time compiles, which a
helper captured as an interpreter function would break.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def per_token_quant_kernel(
    x_ptr, q_ptr, scale_ptr, N, stride_xm, stride_qm,
    BLOCK: tl.constexpr, EPS: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
):
    # One program per row, two passes over it: the absolute max, then the
    # quantized values. EPS / QMAX are constexpr so eager and torch.compile
    # calls compile the very same kernel (no float scalar specialisation).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / QMAX
    tl.store(scale_ptr + row, scale)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
        if IS_INT:
            # Round half to even (torch.round), portable to the interpreter,
            # CUDA and ROCm where libdevice.rint is not.
            r = tl.floor(y + 0.5)
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            y = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
        tl.store(q_row + start + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
