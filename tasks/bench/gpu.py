"""GPU timing: CUDA-graph replay (the decision metric) and eager timing beside it.

Why a graph: eager timing credits a fused kernel for every Python dispatch it
removes; inside a replayed graph the launch overhead is gone for the kernel and
the reference alike, so the numbers are what users of a captured model see.

Why a rotated input pool: a benchmark that feeds the same buffers to every
call measures the L2 cache, not the kernel. The pool holds enough distinct
input sets to exceed ``factor`` × L2, and calls walk it round-robin so a set
is reused only after every other set has been read.

Pool sizing and rotation order are pure and tested without a GPU; the timers
need CUDA and run in GPU-marked tests and ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

L2_FACTOR = 3  # pool bytes ≥ 3 × L2: a set is cold by the time it comes round again
MAX_POOL = 256  # bounds capture time and graph size for tiny inputs
MEMORY_SHARE = 0.25  # of free device memory the pool may use
UNKNOWN_L2 = 256 << 20  # bytes, when the device does not report its L2 size


# Any: torch objects; torch carries its own types only where it is installed
def tensor_bytes(inputs: Any) -> int:
    """Bytes of every tensor in ``inputs`` (nested tuples/lists/dicts)."""
    if hasattr(inputs, "nbytes") and hasattr(inputs, "device"):
        return int(inputs.nbytes)
    if isinstance(inputs, dict):
        return sum(tensor_bytes(v) for v in inputs.values())
    if isinstance(inputs, (tuple, list)):
        return sum(tensor_bytes(v) for v in inputs)
    return 0


def pool_size(
    set_bytes: int,
    l2_bytes: int,
    *,
    factor: float = L2_FACTOR,
    maximum: int = MAX_POOL,
    memory_budget: int | None = None,
) -> int:
    """How many distinct input sets make the pool larger than ``factor`` × L2.

    Capped by ``maximum`` and by ``memory_budget`` bytes; never below one set.
    A set already larger than ``factor`` × L2 needs no company.
    """
    if set_bytes < 0 or l2_bytes < 0:
        raise ValueError(f"sizes must be non-negative (set_bytes={set_bytes}, l2_bytes={l2_bytes})")
    if set_bytes == 0:
        return 1  # nothing cacheable to rotate
    wanted = max(1, math.ceil(factor * l2_bytes / set_bytes))
    if memory_budget is not None:
        wanted = min(wanted, max(1, memory_budget // set_bytes))
    return max(1, min(wanted, maximum))


def rotation_order(pool: int, calls: int) -> list[int]:
    """Round-robin indices into the pool: reuse distance is the pool size."""
    if pool < 1 or calls < 1:
        raise ValueError(f"pool and calls must be at least 1 (pool={pool}, calls={calls})")
    return [i % pool for i in range(calls)]


def calls_per_graph(pool: int, minimum: int = 16) -> int:
    """Captured calls: whole laps of the pool, at least ``minimum`` calls."""
    laps = max(1, math.ceil(minimum / pool))
    return pool * laps


@dataclass(frozen=True)
class DeviceCache:
    l2_bytes: int
    free_bytes: int


def device_cache(device: str) -> DeviceCache:
    import torch

    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    free, _total = torch.cuda.mem_get_info(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    if l2 <= 0:
        # Unknown L2: assume a large one, so the pool errs towards cold inputs.
        _log.warning("%s reports no L2 size; sizing input pools for %d MiB", props.name, UNKNOWN_L2 >> 20)
        l2 = UNKNOWN_L2
    return DeviceCache(l2_bytes=l2, free_bytes=int(free))


def plan_pool(make_inputs: Callable[[str], tuple[Any, ...]], device: str) -> list[tuple[Any, ...]]:
    """Build the rotation pool for one case on ``device``."""
    first = make_inputs(device)
    cache = device_cache(device)
    size = pool_size(tensor_bytes(first), cache.l2_bytes, memory_budget=int(cache.free_bytes * MEMORY_SHARE))
    _log.info("input pool: %d sets of %d bytes (L2 %d bytes)", size, tensor_bytes(first), cache.l2_bytes)
    return [first] + [make_inputs(device) for _ in range(size - 1)]


def _warm_up(fn: Callable[..., Any], pool: Sequence[tuple[Any, ...]], calls: int) -> None:
    """Compile/autotune outside the capture, on a side stream as graph capture requires."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for index in rotation_order(len(pool), calls):
            fn(*pool[index])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def _capture(fn: Callable[..., Any], pool: Sequence[tuple[Any, ...]], order: list[int]) -> Any:
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in order:
            fn(*pool[index])
    graph.replay()  # the first replay uploads the graph; not a sample
    torch.cuda.synchronize()
    return graph


# Any: torch objects; torch carries its own types only where it is installed
def _timed_replay(graph: Any) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


@dataclass(frozen=True)
class GraphReplayTimer:
    """Capture K rotated calls of each op into a CUDA graph; time alternating replays with events.

    Alternating kernel and reference replays puts both through the same clock
    and thermal state, so their paired ratio is robust to drift.
    """

    repeats: int = 25
    warmup: int = 3

    def __call__(self, fn: Callable[..., Any], reference: Callable[..., Any],
                 pool: Sequence[tuple[Any, ...]]) -> tuple[list[float], list[float]]:
        order = rotation_order(len(pool), calls_per_graph(len(pool)))
        graphs = []
        for op in (fn, reference):
            _warm_up(op, pool, max(self.warmup, len(pool)))
            graphs.append(_capture(op, pool, order))
        kernel: list[float] = []
        ref: list[float] = []
        for _ in range(self.repeats):
            kernel.append(_timed_replay(graphs[0]) / len(order))
            ref.append(_timed_replay(graphs[1]) / len(order))
        return kernel, ref


@dataclass(frozen=True)
class EagerTimer:
    """Events around single rotated calls, kernel and reference alternating: what a Python caller pays."""

    calls: int = 100
    warmup: int = 3

    def __call__(self, fn: Callable[..., Any], reference: Callable[..., Any],
                 pool: Sequence[tuple[Any, ...]]) -> tuple[list[float], list[float]]:
        import torch

        for op in (fn, reference):
            _warm_up(op, pool, max(self.warmup, len(pool)))
        events: tuple[list[Any], list[Any]] = ([], [])
        for index in rotation_order(len(pool), self.calls):
            for op, recorded in zip((fn, reference), events, strict=True):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                op(*pool[index])
                end.record()
                recorded.append((start, end))
        torch.cuda.synchronize()
        kernel, ref = ([start.elapsed_time(end) / 1e3 for start, end in recorded] for recorded in events)
        return kernel, ref
