"""One launch helper for every Triton op: a precompiled artifact when the
wheel ships one for this device, else Triton's JIT.

Everything here works from host metadata only (shapes, dtypes, the cached
platform): no device sync in the per-call path.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.errors import KernelUnavailableError
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


_variants: dict[int, Any] = {}


def runnable(jit_fn: Any, interpreter: bool) -> Any:
    """``jit_fn`` in the form this mode runs.

    ``@triton.jit`` picks JIT or interpreter once, when its module is
    imported. A kernel imported in interpreter mode is rebuilt as a real
    ``JITFunction`` for a GPU. The other way round cannot be done (the
    interpreter re-reads the kernel from its module), so that case is a
    clear error instead of Triton's "Cannot call @triton.jit'd outside of
    the scope of a kernel"."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(jit_fn, InterpretedFunction) == interpreter:
        return jit_fn
    if interpreter:
        raise KernelUnavailableError(
            f"{jit_fn.__name__}: TRITON_INTERPRET=1 was set after the kernel's module was imported; "
            "set it before importing kernels (or before the first kernel call) and restart"
        )
    if id(jit_fn) not in _variants:
        _variants[id(jit_fn)] = JITFunction(jit_fn.fn)
    return _variants[id(jit_fn)]
