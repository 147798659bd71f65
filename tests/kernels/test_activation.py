"""The CUDA C++ kernel: a clear typed error without a GPU, never a crash."""

from __future__ import annotations

import pytest
import torch

import kiln_kernels
from kiln_kernels import activation
from kiln_kernels.platform import record_paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_the_op_without_a_gpu_falls_back_and_says_why(caplog):
    import logging

    activation._library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kiln.kernels.activation"):
        assert activation._library() is None
    assert "no CUDA GPU" in caplog.text


def test_missing_library_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(kiln_kernels.KernelUnavailableError, match="not found"):
        kiln_kernels.load_library(tmp_path / activation.LIBRARY)


def test_unloadable_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    bogus = tmp_path / activation.LIBRARY
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(kiln_kernels.KernelUnavailableError, match="cannot load"):
        kiln_kernels.load_library(bogus)


def test_kernel_unavailable_is_an_exception_not_a_base_exception():
    assert issubclass(kiln_kernels.KernelUnavailableError, Exception)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_op_on_cpu_runs_the_reference(dtype):
    x = torch.randn(5, 14).to(dtype)
    with record_paths() as seen:
        out = kiln_kernels.silu_and_mul(x)
    assert seen == [("silu_and_mul", "reference")]
    xd = x.double()
    expect = torch.nn.functional.silu(xd[:, :7]) * xd[:, 7:]
    torch.testing.assert_close(out.double(), expect, rtol=1e-2, atol=1e-2)


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="2D"):
        kiln_kernels.silu_and_mul(torch.randn(2, 5))


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
def test_the_csrc_library_is_a_torch_extension_registering_its_cuda_op(tmp_path):
    """Kiln's nvcc stage builds the sources against the installed torch (here a CPU build) for the
    planned arch; the library loads into torch without a GPU and registers a CUDA kernel."""
    from pathlib import Path

    from kiln.tasks.build.nvcc import build_library, find_nvcc, torch_settings

    nvcc = find_nvcc()
    package = Path(activation.__file__).parent
    lib = tmp_path / activation.LIBRARY
    lib.write_bytes(build_library(nvcc, [package / s for s in activation.SOURCES], activation.LIBRARY, ("9.0",),
                                  timeout=1200, settings=torch_settings()))
    assert kiln_kernels.load_library(lib) == lib
    assert torch.ops.kiln_csrc.abi_version() == activation.ABI_VERSION
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kiln_csrc::silu_and_mul", "CUDA")
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.kiln_csrc.silu_and_mul(torch.randn(2, 4))  # registered for CUDA only
