"""Test doubles for the benchmark stage: a deterministic fake timer and fake cases.

The fake timer replaces the clock only (fault injection for statistics): it
draws per-call times from a seeded log-normal around a chosen median, so a
test states the true slowdown and the noise, and the verdict is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from kiln.core.record import Checkout, RunHeader, create_record
from kiln.core.store import Store
from kiln.tasks.bench.harness import MetricPlan, measure_case
from kiln.tasks.bench.results import BenchResults, Hardware, parse_time

CPU_PLAN = MetricPlan("cpu", "cpu", ("cpu",))


@dataclass(frozen=True)
class FakeOp:
    """Stands for a kernel or its reference; the fake timer reads ``role``, never calls it."""

    role: str  # "kernel" or "reference"

    def __call__(self, *_: Any) -> None:
        raise AssertionError("the fake timer must not run the op")


def fake_cases() -> list[SimpleNamespace]:
    """Three cases over two kernels; fn/reference are distinct objects the fake timer keys on."""
    cases = []
    for kernel, names in (("axpy", ("n1024", "n4096")), ("rownorm", ("m8_n128",))):
        for name in names:
            cases.append(SimpleNamespace(
                kernel=kernel, name=name, shape={"N": 1}, dtype="float32", make_inputs=lambda device: (),
                fn=FakeOp("kernel"), reference=FakeOp("reference"),
                bytes=4096, flops=0,
            ))
    return cases


@dataclass
class FakeTimer:
    """Seeded log-normal per-call times: ``kernel`` × the case's scale for fn, ``reference`` for the reference."""

    kernel: float = 1e-3
    reference: float = 2e-3
    sigma: float = 0.03
    samples: int = 30
    seed: int = 0
    calls: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, fn: Callable[..., Any], reference: Callable[..., Any],
                 pool: Any) -> tuple[list[float], list[float]]:
        self.calls.append((fn.role, reference.role))
        return self._draw(self.kernel), self._draw(self.reference)

    def _draw(self, median: float) -> list[float]:
        return [float(v) for v in median * np.exp(self.rng.normal(0.0, self.sigma, self.samples))]


def fake_run(timer: FakeTimer, run_id: str = "run", flow: str = "nightly", variant: str = "cpu",
             created: str = "2026-11-29T00:00:00Z") -> BenchResults:
    """Measure :func:`fake_cases` through the real harness with ``timer``; wrap them as a results document."""
    results = []
    for case in fake_cases():
        results.extend(measure_case(case, CPU_PLAN, {"cpu": timer}, pool_factory=lambda case, device: [()]))
    return BenchResults(
        commit="0" * 40, variant=variant, flow=flow, run_id=run_id, created=created, size="small",
        decision_metric="cpu", hardware=Hardware(device="cpu", driver="none", cpu="fake"),
        versions={"torch": "test"}, cases=tuple(results),
    )


def run_header(results: BenchResults) -> RunHeader:
    """The header of the run that produced ``results``: its id, flow, commit and start time."""
    return RunHeader(results.run_id, results.flow, "0.1.0", Checkout(results.commit, 0, (), True),
                     parse_time(results.created))


def keep(store: Store, config: Any, results: BenchResults, channel: str | None = None) -> str:
    """Store ``results`` as their run does: its record started (header), then its history entry."""
    from kiln.tasks.bench.history import store_results

    header = run_header(results)
    create_record(store, header, config.root / "views")
    return store_results(store, config, results, header, channel)
