"""GPU-only checks: model-sized shapes, no host syncs, CUDA-graph capture,
the csrc library and a precompiled artifact actually launched. Skipped
without CUDA; ``benchmarks/gpu_check.sh`` runs them on a GPU machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import kiln_kernels
from kiln_kernels import _loader, activation, bench_cases, quant, selfcheck
from kiln_kernels.platform import current_platform, record_paths

pytestmark = pytest.mark.gpu


def _cases():
    cases = []
    for factory in (bench_cases.quant_cases, bench_cases.router_cases, bench_cases.decode_cases):
        cases += factory("large")
    if current_platform().backend == "cuda":
        cases += bench_cases.activation_cases("large")
    return cases


@pytest.fixture(scope="module")
def large_cases():
    return _cases() if torch.cuda.is_available() else []


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def test_large_shapes_match_reference(large_cases):
    for case in large_cases:
        inputs = case.make_inputs("cuda")
        ref = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        got, want = _first(case.fn(*inputs)), _first(case.reference(*ref))
        tol = 1.0 if got.dtype in (torch.int8, torch.float8_e4m3fn) else 3e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=case.name)
        if len(inputs) == 7:  # decode: the updated pools agree too
            torch.testing.assert_close(inputs[5], ref[5], rtol=1e-3, atol=1e-3)


def test_no_host_sync_in_any_op(large_cases):
    for case in large_cases:
        inputs = case.make_inputs("cuda")
        case.fn(*inputs)  # warm-up: JIT compile, library load, platform cache
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            case.fn(*inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_every_op_captures_into_a_cuda_graph_and_replays(large_cases):
    for case in large_cases:
        inputs = case.make_inputs("cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            case.fn(*inputs)  # warm-up off the default stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _first(case.fn(*inputs))
        fresh = case.make_inputs("cuda")
        for dst, src in zip(inputs, fresh, strict=False):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = _first(case.reference(*fresh))
        tol = 1.0 if out.dtype in (torch.int8, torch.float8_e4m3fn) else 3e-2
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol, msg=case.name)


def test_quant_fp8_runs_the_kernel_where_supported():
    plat = current_platform()
    if not (plat.cuda_at_least("8.9") or plat.hip_at_least("gfx942")):
        pytest.skip("fp8 needs sm_89+ or gfx942+")
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    with record_paths() as seen:
        q, scale = kiln_kernels.per_token_quant(x, torch.float8_e4m3fn)
    assert seen == [("per_token_quant", "triton")]
    rq, rscale = quant.reference(x.cpu(), torch.float8_e4m3fn)
    torch.testing.assert_close(scale.cpu(), rscale)
    torch.testing.assert_close(q.cpu().float(), rq.float(), rtol=0.13, atol=2**-9)


def test_router_triton_path_matches_mm_path():
    hidden = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)
    weight = kiln_kernels.stage_router_weight(torch.randn(128, 2048, device="cuda"))
    from kiln_kernels import router

    torch.testing.assert_close(router._triton(hidden, weight), router.reference(hidden, weight),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_csrc_library_builds_loads_and_matches(tmp_path):
    if current_platform().backend != "cuda":
        pytest.skip("CUDA only")
    from kiln.tasks.build.nvcc import build_library, find_nvcc, torch_settings

    major, minor = torch.cuda.get_device_capability()
    lib = tmp_path / activation.LIBRARY
    package = Path(activation.__file__).parent
    lib.write_bytes(build_library(find_nvcc(), [package / s for s in activation.SOURCES], activation.LIBRARY,
                                  (f"{major}.{minor}",), timeout=1200, settings=torch_settings()))
    kiln_kernels.load_library(lib)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(333, 2 * 1000, device="cuda", dtype=dtype)
        got = activation._csrc(x)
        torch.testing.assert_close(got.float(), activation.reference(x).float(), rtol=2e-2, atol=2e-2)


def test_precompiled_artifact_is_launched(tmp_path):
    plat = current_platform()
    selfcheck.build(tmp_path, plat.backend, plat.arch)
    try:
        _loader.LOADER.use_root(tmp_path)
        rows = selfcheck.run_checks()
    finally:
        _loader.LOADER.use_root(_loader.AOT_DIR)
    assert all(r["aot_used"] for r in rows), rows
    assert all(r["ok"] for r in rows), rows
