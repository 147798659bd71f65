"""One launch helper for every Triton op: a precompiled artifact when the
wheel ships one for this device, else Triton's JIT.

The choice between the two is :class:`kiln.runtime.loader.Loader`'s; this
module only maps the package's platform and errors onto it. Everything here
works from host metadata only (shapes, dtypes, the cached platform): no
device sync in the per-call path.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.runtime.loader import InterpreterModeError, divisible_by_16  # noqa: F401 - divisible_by_16: public here too
from kiln_kernels.errors import KernelUnavailableError
from kiln_kernels.platform import current_platform

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
    """Run ``jit_fn[grid](*args, **constexprs)`` through the shipped loader.

    ``constexprs`` must list the kernel's constexpr parameters in signature
    order, after all runtime ``args``: a precompiled kernel takes every
    argument positionally.
    """
    from kiln_kernels import _loader

    platform = current_platform(device)
    try:
        _loader.LOADER.launch(kernel, entry, specialization, jit_fn, grid, args, constexprs,
                              _loader.device(platform), **options)
    except InterpreterModeError as exc:
        raise KernelUnavailableError(str(exc)) from exc


def runnable(jit_fn: Any, interpreter: bool) -> Any:
    """``jit_fn`` in the form this mode runs (see :func:`kiln.runtime.loader.runnable`)."""
    from kiln.runtime.loader import runnable as shipped

    try:
        return shipped(jit_fn, interpreter)
    except InterpreterModeError as exc:
        raise KernelUnavailableError(str(exc)) from exc
