"""Double gating: platform predicates × settings, as pure functions."""

from __future__ import annotations

import pytest
import torch

from kiln_kernels import activation, decode, quant, router
from kiln_kernels.platform import Platform, Settings, cuda_arch_key, current_platform, record_paths

H100 = Platform("cuda", "9.0", triton_version="3.6.0", torch_version="2.9.0")
A100_OLD_TORCH = Platform("cuda", "8.0", triton_version="3.6.0", torch_version="2.7.1")
L40 = Platform("cuda", "8.9", triton_version="3.6.0")
A100 = Platform("cuda", "8.0", triton_version="3.6.0")
T4 = Platform("cuda", "7.5", triton_version="3.6.0")
MI300 = Platform("hip", "gfx942", triton_version="3.6.0")
MI250 = Platform("hip", "gfx90a", triton_version="3.6.0")
RDNA3 = Platform("hip", "gfx1100", triton_version="3.6.0")
CPU_INTERP = Platform("cpu", interpreter=True, triton_version="3.6.0")
CPU = Platform("cpu", triton_version="3.6.0")
NO_TRITON = Platform("cuda", "9.0", triton_version=None)
ON, OFF = Settings(), Settings.from_env({"KILN_DISABLE_ALL": "1"})


def test_settings_read_one_switch_per_kernel():
    s = Settings.from_env({"KILN_DISABLE_ROUTER_LOGITS": "1", "KILN_DISABLE_PER_TOKEN_QUANT": "0", "HOME": "/"})
    assert not s.allows("router_logits")
    assert s.allows("per_token_quant") and s.allows("gated_delta_decode")


@pytest.mark.parametrize("arch, key", [("9.0", (9, 0)), ("9.0a", (9, 0)), ("10.0f", (10, 0)), ("12", (12, 0))])
def test_cuda_arch_key_ignores_suffix(arch, key):
    assert cuda_arch_key(arch) == key


def test_cuda_arch_key_rejects_rocm_names():
    with pytest.raises(ValueError, match="not a CUDA arch"):
        cuda_arch_key("gfx942")


@pytest.mark.parametrize(
    "plat, out, expected",
    [
        (H100, torch.int8, "triton"), (H100, torch.float8_e4m3fn, "triton"),
        (L40, torch.float8_e4m3fn, "triton"), (A100, torch.float8_e4m3fn, "reference"),
        (A100, torch.int8, "triton"), (T4, torch.int8, "reference"),
        (MI300, torch.float8_e4m3fn, "triton"), (MI250, torch.float8_e4m3fn, "reference"),
        (MI250, torch.int8, "triton"), (RDNA3, torch.int8, "reference"),
        (CPU_INTERP, torch.int8, "triton"), (CPU_INTERP, torch.float8_e4m3fn, "reference"),
        (CPU, torch.int8, "reference"), (NO_TRITON, torch.int8, "reference"),
    ],
)
def test_quant_eligibility_matrix(plat, out, expected):
    assert quant.quant_path(plat, ON, out) == expected
    assert quant.quant_path(plat, OFF, out) == "reference"


@pytest.mark.parametrize(
    "plat, expected",
    [(H100, "fused_mm"), (A100_OLD_TORCH, "fused_triton"), (MI300, "fused_triton"), (MI250, "fused_triton"),
     (T4, "unfused"), (CPU_INTERP, "fused_triton"), (CPU, "unfused"), (RDNA3, "unfused")],
)
def test_router_eligibility_matrix(plat, expected):
    bf16 = torch.bfloat16
    assert router.router_path(plat, ON, has_bias=False, hidden_dtype=bf16, weight_dtype=bf16) == expected
    assert router.router_path(plat, OFF, has_bias=False, hidden_dtype=bf16, weight_dtype=bf16) == "unfused"


@pytest.mark.parametrize("plat", [H100, A100_OLD_TORCH, MI300, CPU_INTERP])
def test_router_bias_never_takes_a_fused_path(plat):
    bf16 = torch.bfloat16
    assert router.router_path(plat, ON, has_bias=True, hidden_dtype=bf16, weight_dtype=bf16) == "unfused"


def test_router_non_bf16_inputs_are_unfused():
    assert router.router_path(H100, ON, has_bias=False, hidden_dtype=torch.float16,
                              weight_dtype=torch.bfloat16) == "unfused"


@pytest.mark.parametrize("plat, expected", [(H100, "triton"), (MI250, "triton"), (CPU_INTERP, "triton"),
                                            (CPU, "reference"), (T4, "reference"), (NO_TRITON, "reference")])
def test_decode_eligibility_matrix(plat, expected):
    assert decode.decode_path(plat, ON) == expected
    assert decode.decode_path(plat, OFF) == "reference"


@pytest.mark.parametrize("plat, loads, expected", [(H100, True, "csrc"), (H100, False, "reference"),
                                                   (MI300, True, "reference"), (CPU, True, "reference")])
def test_activation_eligibility_matrix(plat, loads, expected):
    assert activation.activation_path(plat, ON, loads) == expected
    assert activation.activation_path(plat, OFF, loads) == "reference"


def test_disable_env_var_forces_reference_path(monkeypatch):
    monkeypatch.setenv("KILN_DISABLE_PER_TOKEN_QUANT", "1")
    from kiln_kernels import platform

    platform.reset()
    with record_paths() as seen:
        quant.per_token_quant(torch.randn(2, 8))
    assert seen == [("per_token_quant", "reference")]


def test_current_platform_on_cpu_tensor_is_cpu():
    assert current_platform("cpu").backend == "cpu"
