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


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
def test_csrc_builds_with_nvcc_and_exposes_the_c_abi(tmp_path, monkeypatch):
    """nvcc builds the source set without a GPU; the library loads through
    ctypes and reports its ABI (launching needs a GPU: see test_gpu.py)."""
    import subprocess
    from pathlib import Path

    src = Path(activation.__file__).parent / activation.SOURCES[0]
    lib = tmp_path / activation.LIBRARY
    subprocess.run(["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90",
                    "-o", str(lib), str(src)], check=True, timeout=300, capture_output=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    handle = kernels.load_library(lib)
    assert handle.kiln_csrc_abi_version() == activation.ABI_VERSION
    assert handle.kiln_silu_and_mul_f32(None, None, -1, 4, None) == -1  # host-side argument check
    assert b"invalid shape" in handle.kiln_csrc_last_error()
