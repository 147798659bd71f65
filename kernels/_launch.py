"""One launch helper for every Triton op: a precompiled artifact when the
wheel ships one for this device, else Triton's JIT.

Everything here works from host metadata only (shapes, dtypes, the cached
platform): no device sync in the per-call path.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.platform import current_platform

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def short(dtype: torch.dtype) -> str:
    """Specialization-name spelling of a dtype (``torch.bfloat16`` -> ``bf16``)."""
    return _SHORT[dtype]


def launch(
    kernel: str,
    entry: str,
    specialization: str,
    jit_fn: Any,
    grid: tuple[int, ...],
    args: tuple,
    constexprs: dict[str, Any],
    device: torch.device,
    **options: Any,
) -> None:
    """Run ``jit_fn[grid](*args, **constexprs)``.

    ``constexprs`` must list the kernel's constexpr parameters in signature
    order, after all runtime ``args``: a precompiled kernel takes every
    argument positionally.
    """
    platform = current_platform(device)
    pre = None
    if platform.backend != "cpu" and not platform.interpreter:
        from kernels import _loader

        pre = _loader.aot_kernel(kernel, entry, specialization, platform)
    if pre is not None and divisible_by_16(args, pre.aligned):
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        pre.kernel[grid3](*args, *constexprs.values())
        return
    runnable(jit_fn, platform.interpreter)[grid](*args, **constexprs, **options)


def divisible_by_16(args: tuple, positions: tuple[int, ...]) -> bool:
    """Whether the arguments at ``positions`` meet an artifact's alignment
    assumptions (tensor: data pointer; int: value). Host metadata only."""
    for i in positions:
        value = args[i].data_ptr() if isinstance(args[i], torch.Tensor) else args[i]
        if value % 16:
            return False
    return True


_variants: dict[tuple[int, bool], Any] = {}


def runnable(jit_fn: Any, interpreter: bool) -> Any:
    """``jit_fn`` in the form this mode runs: ``@triton.jit`` picks JIT or
    interpreter once, when its module is imported, and in a shared test
    process that may have happened before ``TRITON_INTERPRET`` was set (or
    after). Rebuilding from the Python function removes the ordering hazard."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(jit_fn, InterpretedFunction) == interpreter:
        return jit_fn
    key = (id(jit_fn), interpreter)
    if key not in _variants:
        _variants[key] = InterpretedFunction(jit_fn.fn) if interpreter else JITFunction(jit_fn.fn)
    return _variants[key]
