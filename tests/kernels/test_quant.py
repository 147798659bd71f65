"""per_token_quant against a float64 reference, through the Triton
interpreter on a CPU (or the GPU when there is one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln_kernels
from kiln_kernels import quant
from kiln_kernels.platform import record_paths

SHAPES = [(1, 1), (3, 7), (5, 130), (4, 513), (2, 2100)]  # non-powers of two, one over both blocks
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref64(x: torch.Tensor, qmax: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    xd = x.double()
    scale = xd.abs().amax(dim=1, keepdim=True).clamp_min(quant.EPS) / qmax
    return torch.round(xd / scale).clamp(-qmax, qmax), scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_matches_float64_reference(shape, dtype, device):
    x = torch.randn(shape, device=device).to(dtype)
    with record_paths() as seen:
        q, scale = kiln_kernels.per_token_quant(x)
    assert seen == [("per_token_quant", "triton")]
    assert q.dtype == torch.int8 and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0], 1)
    rq, rscale = ref64(x.cpu())
    torch.testing.assert_close(scale.cpu().double(), rscale, rtol=1e-6, atol=0)
    diff = (q.cpu().double() - rq).abs()
    assert diff.max() <= 1
    # Only a value on a rounding boundary (x/scale ≈ k + 0.5, within the float32
    # kernel's rounding error) may land on the other side; low-precision inputs
    # hit such ties often, so their count is no measure of correctness.
    exact = x.cpu().double() / rscale
    near_tie = ((exact - exact.floor()) - 0.5).abs() <= 1e-4 * exact.abs().clamp_min(1.0)
    assert not ((diff > 0) & ~near_tie).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_round_trip_within_half_a_step(dtype, device):
    x = torch.randn(6, 333, device=device).to(dtype)
    q, scale = kiln_kernels.per_token_quant(x)
    err = (q.float() * scale - x.float()).abs()
    assert (err <= 0.5 * scale * (1 + 1e-5)).all()


def test_all_zero_rows_give_zero_codes_and_eps_scale(device):
    x = torch.randn(4, 100, device=device)
    x[1] = 0
    x[3] = 0
    q, scale = kiln_kernels.per_token_quant(x)
    assert (q[[1, 3]] == 0).all()
    torch.testing.assert_close(scale[[1, 3]].cpu(), torch.full((2, 1), quant.EPS / 127.0))
    assert q[0].abs().max() == 127


@pytest.mark.parametrize("dtype, huge", [(torch.float32, 3e38), (torch.float16, 65504.0), (torch.bfloat16, 3e38)])
def test_one_huge_value_saturates_only_itself(dtype, huge, device):
    x = torch.randn(3, 77, device=device).to(dtype)
    x[1, 40] = huge
    x[2, 5] = -huge
    q, scale = kiln_kernels.per_token_quant(x)
    assert torch.isfinite(scale).all()
    assert q[1, 40] == 127 and q[2, 5] == -127
    # everything else in those rows is tiny next to the max and rounds to 0
    assert (q[1, :40] == 0).all() and (q[2, 6:] == 0).all()
    rq, _ = ref64(x[:1].cpu())
    assert (q[:1].cpu().double() - rq).abs().max() <= 1


def test_fp8_matches_reference_within_one_e4m3_step(device):
    x = torch.randn(5, 129, device=device)
    q, scale = kiln_kernels.per_token_quant(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
    xd = x.cpu().double()
    rscale = xd.abs().amax(dim=1, keepdim=True) / 448.0
    torch.testing.assert_close(scale.cpu().double(), rscale, rtol=1e-6, atol=0)
    y = xd / rscale
    # e4m3 has 3 mantissa bits: relative step 2^-3 for normal numbers
    assert ((q.cpu().double() - y).abs() <= y.abs() * 2**-4 + 2**-9).all()


def test_fp8_on_the_interpreter_takes_the_reference_path():
    """The interpreter's fp8 conversion is not faithful (it flushes subnormals
    and misrounds at binade edges), so fp8 runs the kernel only on a GPU."""
    if torch.cuda.is_available():
        pytest.skip("interpreter-only behaviour")
    with record_paths() as seen:
        kiln_kernels.per_token_quant(torch.randn(2, 8), torch.float8_e4m3fn)
    assert seen == [("per_token_quant", "reference")]


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        kiln_kernels.per_token_quant(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="output dtype"):
        kiln_kernels.per_token_quant(torch.randn(2, 3), torch.int16)
    with pytest.raises(TypeError, match="input dtype"):
        kiln_kernels.per_token_quant(torch.randn(2, 3).double())


def test_same_output_under_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x = torch.randn(5, 130, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: kiln_kernels.per_token_quant(t), fullgraph=True, backend="aot_eager")
    q_c, s_c = compiled(x)
    q_e, s_e = kiln_kernels.per_token_quant(x)
    assert torch.equal(q_c, q_e) and torch.equal(s_c, s_e)


@pytest.mark.slow
def test_same_output_under_inductor(device):
    """The real compiler, around the op: EPS/QMAX are constexpr, so the
    compiled graph launches the very same kernel as eager (~20 s on a CPU)."""
    torch._dynamo.reset()
    x = torch.randn(5, 130, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: kiln_kernels.per_token_quant(t * 2.0), fullgraph=True)
    q_c, s_c = compiled(x)
    q_e, s_e = kiln_kernels.per_token_quant(x * 2.0)
    assert torch.equal(q_c, q_e) and torch.equal(s_c, s_e)


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 70),
    log_scale=st.floats(-20, 20), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
)
def test_round_trip_bound_holds_for_any_row_magnitude(rows, cols, log_scale, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max
    x = (torch.randn(rows, cols, generator=gen) * 2.0**log_scale).clamp(-big, big).to(dtype)
    q, scale = kiln_kernels.per_token_quant(x)
    err = (q.double() * scale.double() - x.double()).abs()
    assert (err <= 0.5 * scale.double() * (1 + 1e-5) + 1e-30).all()
    assert q.abs().max() <= 127


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
@pytest.mark.parametrize("disabled", [False, True])
def test_empty_inputs_give_empty_codes(shape, disabled, monkeypatch):
    if disabled:
        monkeypatch.setenv("KILN_DISABLE_PER_TOKEN_QUANT", "1")
    q, scale = kiln_kernels.per_token_quant(torch.randn(shape))
    assert q.shape == shape and scale.shape == (shape[0], 1)
    torch.testing.assert_close(scale, torch.full((shape[0], 1), quant.EPS / 127.0))
