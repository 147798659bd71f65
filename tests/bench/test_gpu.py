"""The GPU timers for real: graph capture, events, rotation through a pool larger than L2.

Skipped without a GPU (tests/conftest.py); benchmarks/gpu_check.sh runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.tasks.bench.gpu import (
    L2_FACTOR,
    MAX_POOL,
    EagerTimer,
    GraphReplayTimer,
    calls_per_graph,
    device_cache,
    plan_pool,
    tensor_bytes,
)
from kiln.tasks.bench.harness import bench_kernel, bench_specs, resolve_metric
from kiln.tasks.project.config import load_config

pytestmark = pytest.mark.gpu


def test_the_pool_is_larger_than_l2_or_capped():
    pool = plan_pool(lambda device: (torch.randn(1 << 18, device=device),), "cuda")  # 1 MiB sets
    l2 = device_cache("cuda").l2_bytes
    assert l2 > 0
    assert len(pool) == MAX_POOL or len(pool) * tensor_bytes(pool[0]) >= L2_FACTOR * l2
    assert len({t[0].data_ptr() for t in pool}) == len(pool)  # distinct buffers, not views of one


def test_graph_replay_rotates_through_every_input_set_equally():
    pool = [(torch.zeros(1024, device="cuda"),) for _ in range(5)]
    repeats = 4
    kernel, reference = GraphReplayTimer(repeats=repeats, warmup=1)(lambda x: x.add_(1), lambda x: x.sum(), pool)
    torch.cuda.synchronize()
    laps = calls_per_graph(5) // 5
    expected = 1 + (repeats + 1) * laps  # one warm-up lap, the upload replay, the timed replays
    assert [float(t[0][0]) for t in pool] == [expected] * 5
    assert len(kernel) == len(reference) == repeats and min(kernel + reference) > 0


def test_graph_replay_removes_the_launch_overhead_eager_timing_pays():
    pool = [(torch.randn(256, device="cuda"),) for _ in range(4)]
    op = lambda x: x * 2 + 1  # noqa: E731 - two tiny launches: dominated by dispatch when eager
    graph, _ = GraphReplayTimer(repeats=20)(op, op, pool)
    eager, _ = EagerTimer(calls=200)(op, op, pool)
    assert sorted(graph)[len(graph) // 2] < sorted(eager)[len(eager) // 2]


def test_a_gpu_run_of_a_project_reports_graph_replay_with_eager_beside(tmp_path: Path, benchproj: Path):
    config = load_config(benchproj)
    (spec,) = bench_specs(config, ["axpy"])
    results = bench_kernel(spec, "small", resolve_metric("auto", cuda_available=True))
    assert [(r.name, r.metric) for r in results] == [
        ("n1024", "graph_replay"), ("n1024", "eager"), ("n4096", "graph_replay"), ("n4096", "eager")]
    assert all(r.reference is not None and r.stats.median > 0 for r in results)
