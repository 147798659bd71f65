"""Kernel tests: on a machine without CUDA, Triton kernels run through the
Triton interpreter. ``TRITON_INTERPRET`` must be set before the kernel
modules (``kernels._*_tl``) are imported; ``kernels`` imports them lazily, so
setting it here, at collection, is early enough."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import platform  # noqa: E402  (after TRITON_INTERPRET)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_platform():
    """Each test sees the environment it set (KILN_DISABLE_*), not a cache."""
    platform.reset()
    yield
    platform.reset()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
