"""The CUDA C++ kernel: a clear typed error without a GPU, never a crash."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import activation
from kernels.platform import record_paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_loading_without_a_gpu_raises_kernel_unavailable():
    with pytest.raises(kernels.KernelUnavailableError, match="no CUDA GPU"):
        kernels.load_library()


def test_missing_library_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(kernels.KernelUnavailableError, match="not found"):
        kernels.load_library(tmp_path / activation.LIBRARY)


def test_unloadable_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    bogus = tmp_path / activation.LIBRARY
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(kernels.KernelUnavailableError, match="cannot load"):
        kernels.load_library(bogus)


def test_kernel_unavailable_is_an_exception_not_a_base_exception():
    assert issubclass(kernels.KernelUnavailableError, Exception)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_op_on_cpu_runs_the_reference(dtype):
    x = torch.randn(5, 14).to(dtype)
    with record_paths() as seen:
        out = kernels.silu_and_mul(x)
    assert seen == [("silu_and_mul", "reference")]
    xd = x.double()
    expect = torch.nn.functional.silu(xd[:, :7]) * xd[:, 7:]
    torch.testing.assert_close(out.double(), expect, rtol=1e-2, atol=1e-2)


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="2D"):
        kernels.silu_and_mul(torch.randn(2, 5))
