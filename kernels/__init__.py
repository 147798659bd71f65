"""Kiln's kernel library: dynamic quantization, the MoE router GEMM, gated
delta-rule decode (Triton) and a fused SiLU-and-mul (CUDA C++).

Each op is a ``torch.library`` custom op (``torch.ops.kiln.*``) with a fake
implementation, so ``torch.compile(fullgraph=True)`` traces through it. A fast
path runs only when the platform supports it and no ``KILN_DISABLE_<KERNEL>``
setting turns it off; otherwise the torch reference runs.
"""

from kernels.activation import activation_path, load_library, silu_and_mul
from kernels.decode import NULL_BLOCK_ID, decode_path, gated_delta_decode
from kernels.errors import KernelError, KernelUnavailableError
from kernels.platform import Platform, Settings, current_platform, current_settings, record_paths
from kernels.quant import per_token_quant, quant_path
from kernels.router import router_logits, router_path, stage_router_weight

__all__ = [
    "NULL_BLOCK_ID",
    "KernelError",
    "KernelUnavailableError",
    "Platform",
    "Settings",
    "activation_path",
    "current_platform",
    "current_settings",
    "decode_path",
    "gated_delta_decode",
    "load_library",
    "per_token_quant",
    "quant_path",
    "record_paths",
    "router_logits",
    "router_path",
    "silu_and_mul",
    "stage_router_weight",
]
