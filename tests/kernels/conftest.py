"""Kernel tests: on a machine without CUDA, Triton kernels run through the
Triton interpreter.

``TRITON_INTERPRET=1`` is set when this conftest is imported, before any test
module of the package is collected (setting it later, from a fixture, leaves
Triton half in each mode), and the previous value is restored after the
package's last test, so later tests and the subprocesses they start see the
environment they expect."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import kiln_kernels
from kiln_kernels import platform  # imports no Triton kernel module

KERNEL_MODULES = ("_decode_tl", "_quant_tl", "_router_tl")  # each a module of @triton.jit kernels

HAS_CUDA = torch.cuda.is_available()
_SAVED = os.environ.get("TRITON_INTERPRET")
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="package", autouse=True)
def _restore_interpret_setting():
    # Set again on every entry into the package: under pytest-xdist a worker may run other
    # packages between two of this package's files, and the teardown below unset it.
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
        platform.reset()
        _forget_kernel_modules()
    yield
    if _SAVED is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED
    platform.reset()
    _forget_kernel_modules()


def _forget_kernel_modules() -> None:
    """Drop the Triton kernel modules, so the next import makes them in the mode then set: ``@triton.jit`` picks
    JIT or interpreter when its module is imported, and a test of another package in this worker (the registry's
    specializations) may have imported them with the other."""
    for name in KERNEL_MODULES:
        sys.modules.pop(f"kiln_kernels.{name}", None)
        if hasattr(kiln_kernels, name):
            delattr(kiln_kernels, name)


@pytest.fixture(autouse=True)
def _fresh_platform():
    """Each test sees the environment it set (KILN_DISABLE_*), not a cache."""
    platform.reset()
    yield
    platform.reset()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
