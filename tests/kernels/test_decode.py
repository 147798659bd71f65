"""gated_delta_decode against a float64 per-row loop, plus the slot-pool
guarantees: padding rows, slot isolation, untouched slots. Both the Triton
path and the torch fallback are held to the same guarantees."""

from __future__ import annotations

import pytest
import torch

import kiln_kernels
from kiln_kernels import platform
from kiln_kernels.platform import record_paths

NULL = kiln_kernels.NULL_BLOCK_ID


def ref64_step(q, k, v, g, beta, state, slots, scale=None):
    """Straight from the definition, one row and head at a time, float64.
    ``state`` is a float64 copy updated in place."""
    b_rows, heads, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    out = torch.zeros(b_rows, heads, v.shape[-1], dtype=torch.float64)
    for b in range(b_rows):
        s = int(slots[b])
        if s == NULL:
            continue
        for h in range(heads):
            st = torch.exp(g[b, h].double())[:, None] * state[s, h]
            u = v[b, h].double() - st.t() @ k[b, h].double()
            st = st + beta[b, h].double() * torch.outer(k[b, h].double(), u)
            out[b, h] = st.t() @ (q[b, h].double() * scale)
            state[s, h] = st
    return out


def make(b, h, dk, dv, n_slots, dtype, device, slots):
    k = torch.nn.functional.normalize(torch.randn(b, h, dk), dim=-1)
    tensors = (torch.randn(b, h, dk), k, torch.randn(b, h, dv), -torch.rand(b, h, dk) * 0.5,
               torch.rand(b, h) * 0.9 + 0.05)
    q, k, v, g, beta = (t.to(device=device, dtype=dtype) for t in tensors)
    state = torch.randn(n_slots, h, dk, dv, device=device)
    return q, k, v, g, beta, state, torch.tensor(slots, dtype=torch.int32, device=device)


@pytest.fixture(params=["triton", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("KILN_DISABLE_GATED_DELTA_DECODE", "1")
    platform.reset()
    return request.param


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("b, h, dk, dv, slots", [
    (1, 1, 16, 16, [0]), (3, 2, 12, 10, [4, NULL, 1]), (4, 3, 33, 17, [2, 0, 5, 3]), (2, 1, 64, 80, [1, 0]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_float64_reference(b, h, dk, dv, slots, dtype, device, path):
    q, k, v, g, beta, state, slot_ids = make(b, h, dk, dv, 6, dtype, device, slots)
    expect_state = state.cpu().double()
    expect = ref64_step(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), expect_state, slot_ids.cpu())
    with record_paths() as seen:
        out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert seen == [("gated_delta_decode", path)]
    assert out.dtype == dtype and out.shape == (b, h, dv)
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), expect, rtol=tol, atol=tol)
    torch.testing.assert_close(state.cpu().double(), expect_state, rtol=1e-5, atol=1e-5)


def test_explicit_scale_is_used(device, path):
    q, k, v, g, beta, state, slot_ids = make(2, 2, 8, 8, 3, torch.float32, device, [2, 0])
    expect_state = state.cpu().double()
    expect = ref64_step(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), expect_state, slot_ids.cpu(), 0.7)
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids, scale=0.7)
    torch.testing.assert_close(out.cpu().double(), expect, rtol=1e-5, atol=1e-5)


def test_padding_rows_touch_no_slot_and_output_zero(device, path):
    q, k, v, g, beta, state, slot_ids = make(4, 2, 16, 12, 5, torch.float32, device, [NULL, 3, NULL, NULL])
    before = state.clone()
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert torch.equal(out[[0, 2, 3]], torch.zeros_like(out[[0, 2, 3]]))
    others = [0, 1, 2, 4]
    assert torch.equal(state[others], before[others])  # bit-identical, slot 0 included
    assert not torch.equal(state[3], before[3])


def test_all_padding_batch_changes_nothing(device, path):
    q, k, v, g, beta, state, slot_ids = make(3, 1, 8, 8, 2, torch.float32, device, [NULL] * 3)
    before = state.clone()
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert torch.equal(state, before) and not out.any()


@pytest.mark.parametrize("row", [0, 1, 2])
def test_each_row_touches_only_its_own_slot(row, device, path):
    slots = [5, 0, 3]
    q, k, v, g, beta, state, slot_ids = make(3, 2, 16, 8, 7, torch.float32, device, slots)
    only = torch.full((3,), NULL, dtype=torch.int32, device=device)
    only[row] = slots[row]
    before = state.clone()
    kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, only)
    untouched = [s for s in range(7) if s != slots[row]]
    assert torch.equal(state[untouched], before[untouched])


def test_ten_steps_match_ten_reference_steps(device, path):
    slots = [2, NULL, 0, 4]
    state = torch.randn(6, 2, 16, 16, device=device) * 0.1
    expect_state = state.cpu().double()
    before = state.clone()
    for step in range(10):
        q, k, v, g, beta, _, slot_ids = make(4, 2, 16, 16, 1, torch.float32, device, slots)
        out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
        expect = ref64_step(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), expect_state, slot_ids.cpu())
        torch.testing.assert_close(out.cpu().double(), expect, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    torch.testing.assert_close(state.cpu().double(), expect_state, rtol=1e-4, atol=1e-4)
    named_by_no_row = [1, 3, 5]
    assert torch.equal(state[named_by_no_row], before[named_by_no_row])


def test_out_of_range_slot_ids_write_nothing(device, path):
    q, k, v, g, beta, state, slot_ids = make(2, 1, 8, 8, 3, torch.float32, device, [3, -7])
    before = state.clone()
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert torch.equal(state, before) and not out.any()


def test_rejects_bad_shapes_and_dtypes(device):
    q, k, v, g, beta, state, slot_ids = make(2, 1, 8, 8, 3, torch.float32, device, [0, 1])
    with pytest.raises(ValueError, match="k must be"):
        kiln_kernels.gated_delta_decode(q, k[:, :, :4], v, g, beta, state, slot_ids)
    with pytest.raises(TypeError, match="slot_ids"):
        kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids.long())
    with pytest.raises(TypeError, match="float32"):
        kiln_kernels.gated_delta_decode(q, k, v, g, beta, state.half(), slot_ids)


def test_fullgraph_compile_matches_eager(device):
    torch._dynamo.reset()
    args = make(3, 2, 16, 8, 4, torch.float32, device, [1, NULL, 3])
    eager_state = args[5].clone()
    eager = kiln_kernels.gated_delta_decode(*args[:5], eager_state, args[6])
    fn = torch.compile(kiln_kernels.gated_delta_decode, fullgraph=True, backend="aot_eager")
    compiled = fn(*args)
    assert torch.equal(compiled, eager)
    assert torch.equal(args[5], eager_state)  # the in-place update survives functionalization


def test_integer_scale_is_accepted_and_tensor_scale_refused(device):
    args = make(1, 1, 8, 8, 2, torch.float32, device, [1])
    kiln_kernels.gated_delta_decode(*args, scale=1)
    with pytest.raises(TypeError, match="Python number"):
        kiln_kernels.gated_delta_decode(*args, scale=torch.tensor(0.5))


def test_padding_rows_output_zero_even_if_slot_zero_holds_nan(device, path):
    """A padding row is redirected to slot 0 for addressing only; whatever
    slot 0 holds must not leak into its output."""
    q, k, v, g, beta, state, slot_ids = make(2, 1, 8, 8, 3, torch.float32, device, [NULL, 2])
    state[0] = float("nan")
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1]).all()


def test_empty_pool_means_every_row_is_padding(device, path):
    q, k, v, g, beta, state, slot_ids = make(2, 1, 8, 8, 0, torch.float32, device, [0, NULL])
    out = kiln_kernels.gated_delta_decode(q, k, v, g, beta, state, slot_ids)
    assert out.shape == (2, 1, 8) and not out.any()
