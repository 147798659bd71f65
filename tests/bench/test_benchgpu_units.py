"""GPU-path logic that needs no GPU: pool sizing and rotation order."""

from __future__ import annotations

import pytest
import torch

from kiln.tasks.bench.gpu import calls_per_graph, pool_size, rotation_order, tensor_bytes

MiB = 1 << 20


@pytest.mark.parametrize(
    ("set_bytes", "l2", "expected"),
    [
        (1 * MiB, 50 * MiB, 150),   # 3 × 50 MiB of 1 MiB sets
        (7 * MiB, 50 * MiB, 22),    # rounds up: 22 × 7 MiB = 154 MiB ≥ 150 MiB
        (150 * MiB, 50 * MiB, 1),   # one set already exceeds 3 × L2
        (400 * MiB, 50 * MiB, 1),
        (4096, 50 * MiB, 256),      # tiny inputs: capped
        (0, 50 * MiB, 1),           # nothing cacheable to rotate
    ],
)
def test_pool_size_covers_three_times_l2_within_the_cap(set_bytes, l2, expected):
    size = pool_size(set_bytes, l2)
    assert size == expected
    if 1 < size < 256:
        assert size * set_bytes >= 3 * l2 > (size - 1) * set_bytes


def test_pool_size_respects_the_memory_budget():
    assert pool_size(10 * MiB, 50 * MiB, memory_budget=40 * MiB) == 4
    assert pool_size(10 * MiB, 50 * MiB, memory_budget=5 * MiB) == 1  # never below one set


def test_pool_size_refuses_negative_sizes():
    with pytest.raises(ValueError, match="non-negative"):
        pool_size(-1, 50 * MiB)


def test_rotation_reuses_a_set_only_after_every_other_set():
    order = rotation_order(5, 23)
    assert len(order) == 23
    for position, index in enumerate(order):
        later = order[position + 1:]
        if index in later:
            assert later.index(index) + 1 == 5  # reuse distance is the pool size
    assert set(order) == set(range(5))


def test_rotation_uses_every_set_equally_over_whole_laps():
    calls = calls_per_graph(7, minimum=16)
    assert calls == 21 and calls % 7 == 0
    order = rotation_order(7, calls)
    assert all(order.count(i) == 3 for i in range(7))


def test_a_pool_larger_than_the_minimum_is_captured_in_one_lap():
    assert calls_per_graph(150, minimum=16) == 150
    assert calls_per_graph(1, minimum=16) == 16


@pytest.mark.parametrize(("pool", "calls"), [(0, 4), (4, 0)])
def test_rotation_refuses_empty_pools_and_no_calls(pool, calls):
    with pytest.raises(ValueError):
        rotation_order(pool, calls)


def test_tensor_bytes_counts_only_tensors_in_nested_inputs():
    inputs = (torch.zeros(10, 4), [torch.zeros(3, dtype=torch.int8)], {"w": torch.zeros(2, dtype=torch.float64)},
              torch.int8, 3.0)
    assert tensor_bytes(inputs) == 160 + 3 + 16
