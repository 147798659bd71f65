"""Kiln's kernel library: dynamic quantization, the MoE router GEMM, gated
delta-rule decode (Triton) and a fused SiLU-and-mul (CUDA C++).

Each op is a ``torch.library`` custom op (``torch.ops.kiln.*``) with a fake
implementation, so ``torch.compile(fullgraph=True)`` traces through it. A fast
path runs only when the platform supports it and no ``KILN_DISABLE_<KERNEL>``
setting turns it off; otherwise the torch reference runs.
"""

from kiln_kernels.activation import activation_path, load_library, silu_and_mul
from kiln_kernels.decode import NULL_BLOCK_ID, decode_path, gated_delta_decode
from kiln_kernels.errors import KernelError, KernelUnavailableError
from kiln_kernels.platform import Platform, Settings, current_platform, current_settings, record_paths
from kiln_kernels.quant import per_token_quant, quant_path
from kiln_kernels.router import router_logits, router_path, stage_router_weight

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
