"""Errors the kernel library raises on purpose.

``kernels`` may import only torch and triton (docs/explanation/architecture.md), so it cannot derive
from ``kiln.core.errors``; the pipeline translates these where it calls us.
"""

from __future__ import annotations


class KernelError(Exception):
    """Root of every error ``kernels`` raises on purpose."""


class KernelUnavailableError(KernelError):
    """A compiled kernel cannot be used here: no GPU, no built library, or a
    library that does not load. Callers fall back to the torch reference or
    build the library first; the message says which."""
