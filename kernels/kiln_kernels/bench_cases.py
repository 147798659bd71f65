"""Benchmark cases per kernel, for the pipeline's harness.

``"small"`` cases run on a CPU through the Triton interpreter (a few ms a
call); ``"large"`` cases are model-sized, for a GPU. ``bytes``/``flops`` are
the minimum traffic and arithmetic of one call.
"""

from __future__ import annotations

import torch

from kiln.runtime.spec import BenchCase
from kiln_kernels import activation, decode, quant, router

_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def _check(size: str) -> None:
    if size not in ("small", "large"):
        raise ValueError(f"bench size must be 'small' or 'large', got {size!r}")


def quant_cases(size: str) -> list[BenchCase]:
    _check(size)
    shapes = [(2, 256, torch.float32, torch.int8), (2, 1000, torch.bfloat16, torch.int8)]
    if size == "large":
        shapes = [(4096, 7168, torch.bfloat16, torch.int8), (4096, 7168, torch.bfloat16, torch.float8_e4m3fn),
                  (16, 7168, torch.float16, torch.int8)]
    return [
        BenchCase(
            kernel="per_token_quant", name=f"m{m}_n{n}_{str(dt)[6:]}_{str(out)[6:]}",
            shape={"M": m, "N": n}, dtype=str(dt)[6:],
            make_inputs=lambda device, m=m, n=n, dt=dt, out=out: (
                torch.randn(m, n, device=device, dtype=dt), out),
            fn=quant.per_token_quant, reference=quant.reference,
            bytes=m * n * (_SIZE[dt] + 1) + m * 4, flops=3 * m * n,
        )
        for m, n, dt, out in shapes
    ]


def router_cases(size: str) -> list[BenchCase]:
    _check(size)
    shapes = [(8, 64, 16), (5, 96, 24)]  # (T, D, E)
    if size == "large":
        shapes = [(4096, 7168, 256), (64, 7168, 256), (1, 4096, 128)]

    def make(device: str, t: int, d: int, e: int) -> tuple:
        hidden = torch.randn(t, d, device=device, dtype=torch.bfloat16)
        return hidden, router.stage_router_weight(torch.randn(e, d, device=device))

    return [
        BenchCase(
            kernel="router_logits", name=f"t{t}_d{d}_e{e}", shape={"T": t, "D": d, "E": e}, dtype="bfloat16",
            make_inputs=lambda device, t=t, d=d, e=e: make(device, t, d, e),
            fn=router.router_logits, reference=router.reference,
            bytes=(t * d + e * d) * 2 + t * e * 4, flops=2 * t * d * e,
        )
        for t, d, e in shapes
    ]


def _decode_inputs(device: str, b: int, h: int, k: int, v: int, s: int, dt: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(b * 1000 + s)
    slots = torch.randperm(s, generator=gen)[:b].to(torch.int32)
    slots[::4] = decode.NULL_BLOCK_ID  # every fourth row is padding
    kk = torch.nn.functional.normalize(torch.randn(b, h, k), dim=-1)
    return (
        torch.randn(b, h, k, device=device, dtype=dt), kk.to(device=device, dtype=dt),
        torch.randn(b, h, v, device=device, dtype=dt), (-torch.rand(b, h, k) * 0.1).to(device=device, dtype=dt),
        torch.rand(b, h, device=device).to(dt), torch.randn(s, h, k, v, device=device) * 0.1,
        slots.to(device),
    )


def decode_cases(size: str) -> list[BenchCase]:
    _check(size)
    shapes = [(2, 1, 16, 16, 8, torch.float32), (1, 2, 24, 20, 6, torch.bfloat16)]
    if size == "large":
        shapes = [(256, 32, 128, 128, 512, torch.bfloat16), (8, 32, 128, 128, 64, torch.bfloat16)]
    return [
        BenchCase(
            kernel="gated_delta_decode", name=f"b{b}_h{h}_k{k}_v{v}_s{s}_{str(dt)[6:]}",
            shape={"B": b, "H": h, "K": k, "V": v, "S": s}, dtype=str(dt)[6:],
            make_inputs=lambda device, a=(b, h, k, v, s, dt): _decode_inputs(device, *a),
            fn=decode.gated_delta_decode, reference=decode.reference,
            bytes=2 * b * h * k * v * 4 + b * h * (3 * k + 2 * v + 1) * _SIZE[dt], flops=8 * b * h * k * v,
        )
        for b, h, k, v, s, dt in shapes
    ]


def activation_cases(size: str) -> list[BenchCase]:
    _check(size)
    shapes = [(8, 64, torch.float32)] if size == "small" else [(8192, 14336, torch.bfloat16)]
    return [
        BenchCase(
            kernel="silu_and_mul", name=f"m{m}_d{d}_{str(dt)[6:]}", shape={"M": m, "D": d}, dtype=str(dt)[6:],
            make_inputs=lambda device, m=m, d=d, dt=dt: (torch.randn(m, 2 * d, device=device, dtype=dt),),
            fn=activation.silu_and_mul, reference=activation.reference,
            bytes=3 * m * d * _SIZE[dt], flops=5 * m * d,
        )
        for m, d, dt in shapes
    ]
