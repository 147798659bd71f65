"""router_logits: float32 logits of bf16 inputs; the fused path never drops a bias."""

from __future__ import annotations

import pytest
import torch

import kiln_kernels
from kiln_kernels import platform, router
from kiln_kernels.platform import Platform, record_paths

SHAPES = [(1, 16, 8), (7, 40, 9), (33, 130, 70), (17, 64, 64)]  # (T, D, E)


def ref64(hidden, weight, bias=None):
    out = hidden.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


def _inputs(t, d, e, device):
    hidden = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    return hidden, kiln_kernels.stage_router_weight(torch.randn(e, d), device=device)


@pytest.mark.parametrize("t, d, e", SHAPES)
def test_fused_matches_float64_reference(t, d, e, device):
    hidden, weight = _inputs(t, d, e, device)
    with record_paths() as seen:
        out = kiln_kernels.router_logits(hidden, weight)
    assert seen[0][1].startswith("fused")
    assert out.dtype == torch.float32 and out.shape == (t, e)
    # bf16 x bf16 products are exact in float32; only the float32 sum rounds
    torch.testing.assert_close(out.cpu().double(), ref64(hidden.cpu(), weight.cpu()), rtol=1e-5, atol=1e-4)


def test_fused_equals_unfused(device, monkeypatch):
    hidden, weight = _inputs(19, 72, 11, device)
    fused = kiln_kernels.router_logits(hidden, weight)
    monkeypatch.setenv("KILN_DISABLE_ROUTER_LOGITS", "1")
    platform.reset()
    with record_paths() as seen:
        unfused = kiln_kernels.router_logits(hidden, weight)
    assert seen == [("router_logits", "unfused")]
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias_takes_the_unfused_path_and_is_added(bias_dtype, device):
    hidden, weight = _inputs(6, 48, 10, device)
    bias = (torch.randn(10, device=device) * 10).to(bias_dtype)
    with record_paths() as seen:
        out = kiln_kernels.router_logits(hidden, weight, bias)
    assert seen == [("router_logits", "unfused")]
    torch.testing.assert_close(out.cpu().double(), ref64(hidden.cpu(), weight.cpu(), bias.cpu()),
                               rtol=1e-5, atol=1e-4)


def test_transposed_weight_view_needs_no_staging(device):
    hidden = torch.randn(5, 40, device=device, dtype=torch.bfloat16)
    weight_t = torch.randn(40, 12, device=device, dtype=torch.bfloat16)
    out = kiln_kernels.router_logits(hidden, weight_t.t())
    torch.testing.assert_close(out.cpu().double(), ref64(hidden.cpu(), weight_t.t().cpu()), rtol=1e-5, atol=1e-4)


def test_stage_router_weight_is_contiguous_bf16():
    staged = kiln_kernels.stage_router_weight(torch.randn(30, 8).t())
    assert staged.dtype == torch.bfloat16 and staged.is_contiguous() and staged.shape == (8, 30)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="share D"):
        kiln_kernels.router_logits(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kiln_kernels.router_logits(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16),
                              torch.randn(5))


def test_fullgraph_compile_traces_through_with_and_without_bias(device):
    torch._dynamo.reset()
    hidden, weight = _inputs(9, 32, 6, device)
    bias = torch.randn(6, device=device)
    fn = torch.compile(kiln_kernels.router_logits, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(hidden, weight), kiln_kernels.router_logits(hidden, weight))
    torch.testing.assert_close(fn(hidden, weight, bias), kiln_kernels.router_logits(hidden, weight, bias))


@pytest.mark.parametrize("plat", [
    Platform("cuda", "9.0", triton_version="3.6.0", torch_version="2.9.0"),
    Platform("hip", "gfx942", triton_version="3.6.0"),
])
def test_bias_is_never_dropped_on_a_gpu_platform(plat, monkeypatch):
    """The op itself, on a monkeypatched CUDA/ROCm platform: with a bias the
    unfused path runs and the bias is in the result."""
    monkeypatch.setattr(router, "current_platform", lambda device=None: plat)
    hidden, weight = _inputs(4, 32, 5, "cpu")
    bias = torch.full((5,), 100.0)
    with record_paths() as seen:
        out = kiln_kernels.router_logits(hidden, weight, bias)
    assert seen == [("router_logits", "unfused")]
    torch.testing.assert_close(out.double(), ref64(hidden, weight, bias), rtol=1e-5, atol=1e-4)
