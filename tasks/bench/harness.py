"""The benchmark harness: every registry case timed beside its torch reference.

On a GPU the decision metric is CUDA-graph replay over a rotated input pool
(:mod:`kiln.tasks.bench.gpu`) with eager timing measured beside it; on the CPU the
same cases go through ``torch.utils.benchmark``. Kernel and reference are
measured back to back in the same run, so their ratio survives machine drift.

Timers are injected: a timer is ``(fn, reference, pool) -> (kernel samples,
reference samples)`` in per-call seconds, so tests hand in a deterministic
fake and exercise everything else for real.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from kiln.core.errors import BenchmarkError, ConfigError, InfrastructureError, KilnError
from kiln.core.manifest import Artifact, Unit
from kiln.tasks.bench import gpu as benchgpu
from kiln.tasks.bench.results import (
    BenchResults,
    CaseResult,
    MetricChoice,
    Stats,
    git_commit,
    hardware,
    library_versions,
)
from kiln.tasks.bench.stats import summarize
from kiln.tasks.project.config import BENCH_SIZES, KilnConfig, Metric, Variant
from kiln.tasks.project.config_matrix import built_for
from kiln.tasks.project.registry import bench_case_record, load_registry
from kiln.tasks.project.registry_types import BenchCaseRecord, KernelRecord

_log = logging.getLogger(__name__)

Timer = Callable[[Callable[..., Any], Callable[..., Any], Sequence[tuple[Any, ...]]], tuple[list[float], list[float]]]
PoolFactory = Callable[[BenchCaseRecord, str], list[tuple[Any, ...]]]
METRICS: tuple[MetricChoice, ...] = get_args(MetricChoice)


@dataclass(frozen=True)
class MetricPlan:
    """Where cases run, which metric decides, and which metrics are measured."""

    device: str
    decision: Metric
    measured: tuple[Metric, ...]


def resolve_metric(metric: str, cuda_available: bool) -> MetricPlan:
    """``auto`` is graph replay on a GPU and ``cpu`` otherwise; eager rides along with graph replay."""
    if metric not in METRICS:
        raise ConfigError(f"metric {metric!r} is not one of {list(METRICS)}")
    if metric == "auto":
        metric = "graph_replay" if cuda_available else "cpu"
    if metric == "cpu":
        return MetricPlan("cpu", "cpu", ("cpu",))
    if not cuda_available:
        raise ConfigError(f"metric {metric!r} needs a CUDA/ROCm device and torch sees none; use --metric cpu or auto")
    if metric == "graph_replay":
        return MetricPlan("cuda", "graph_replay", ("graph_replay", "eager"))
    return MetricPlan("cuda", "eager", ("eager",))


@dataclass(frozen=True)
class CpuTimer:
    """``torch.utils.benchmark``, kernel and reference in alternating blocks of ``block_time``.

    Each sample is the mean per-call time of one block. Alternating blocks put
    kernel and reference through the same load phases of a shared machine,
    so their paired ratio stays put when the machine gets busier. One thread,
    as Timer defaults to, timed by its own CPU clock; inputs are not rotated
    (the CPU path is a drift check, not the GPU decision metric).
    """

    block_time: float = 0.01
    blocks: int = 20
    # CPU time of this thread: a co-tenant that preempts us does not count as our time.
    clock: Callable[[], float] = time.thread_time

    def __call__(self, fn: Callable[..., Any], reference: Callable[..., Any],
                 pool: Sequence[tuple[Any, ...]]) -> tuple[list[float], list[float]]:
        from torch.utils import benchmark

        inputs = pool[0]
        timers = [benchmark.Timer(stmt="op(*inputs)", globals={"op": op, "inputs": inputs}, timer=self.clock)
                  for op in (fn, reference)]
        numbers = [_calls_per_block(timer, self.block_time) for timer in timers]
        kernel: list[float] = []
        ref: list[float] = []
        for _ in range(self.blocks):
            kernel.append(timers[0].timeit(numbers[0]).mean)
            ref.append(timers[1].timeit(numbers[1]).mean)
        return kernel, ref


# Any: a torch.utils.benchmark Timer (torch may be absent where Kiln is type-checked)
def _calls_per_block(timer: Any, block_time: float) -> int:
    timer.timeit(1)  # first call compiles (Triton interpreter, lazy init): not timed
    once = max(timer.timeit(1).mean, 1e-9)  # a coarse clock can read 0 for one fast call
    return max(1, min(int(block_time / once), 1_000_000))


def default_timers(plan: MetricPlan) -> Mapping[str, Timer]:
    available: dict[Metric, Timer] = {
        "cpu": CpuTimer(), "graph_replay": benchgpu.GraphReplayTimer(), "eager": benchgpu.EagerTimer(),
    }
    return {metric: available[metric] for metric in plan.measured}


def make_pool(case: BenchCaseRecord, device: str) -> list[tuple[Any, ...]]:
    if device == "cpu":
        return [tuple(case.make_inputs("cpu"))]
    return [tuple(inputs) for inputs in benchgpu.plan_pool(case.make_inputs, device)]


def stats_of(samples: Sequence[float], what: str) -> Stats:
    summary = summarize(samples, what=what)
    return Stats(samples=tuple(float(s) for s in samples), median=summary.median, spread=summary.spread,
                 ci_low=summary.ci_low, ci_high=summary.ci_high)


def measure_case(
    case: BenchCaseRecord, plan: MetricPlan, timers: Mapping[str, Timer], pool_factory: PoolFactory = make_pool
) -> list[CaseResult]:
    """Time ``case.fn`` and ``case.reference`` with every measured metric, on one pool."""
    where = f"{case.kernel}/{case.name}"
    pool = pool_factory(case, plan.device)
    results = []
    for metric in plan.measured:
        timer = timers[metric]
        _log.info("bench %s [%s]: %d input sets", where, metric, len(pool))
        kernel_samples, reference_samples = timer(case.fn, case.reference, pool)
        kernel = stats_of(kernel_samples, f"{where} {metric}")
        reference = stats_of(reference_samples, f"{where} {metric} reference")
        results.append(CaseResult(
            kernel=case.kernel, name=case.name, shape=dict(case.shape), dtype=case.dtype, metric=metric,
            stats=kernel, reference=reference, bytes=case.bytes, flops=case.flops,
        ))
        _log.info("bench %s [%s]: kernel %.3g s, reference %.3g s", where, metric, kernel.median, reference.median)
    return results


def kernel_cases(spec: KernelRecord, size: str) -> list[BenchCaseRecord]:
    """The kernel's cases for ``size``, validated; a kernel that declares none has nothing to measure."""
    if spec.bench_cases is None:
        return []
    try:
        cases = list(spec.bench_cases(size))
    except Exception as exc:  # the project's code: translate whatever it raises
        raise ConfigError(f"kernel {spec.name!r}: bench_cases({size!r}) raised {type(exc).__name__}: {exc}") from exc
    return [bench_case_record(case, spec.name, size, index) for index, case in enumerate(cases)]


def bench_specs(
    config: KilnConfig, kernels: Sequence[str] | None = None, installed: bool = False
) -> list[KernelRecord]:
    """The registry's kernels, in registry order, optionally only those named.

    ``installed``: import the registry from the installed package (the bench
    stage measures the wheel it ships), not from the project's source tree.
    """
    specs = load_registry(config, installed=installed)
    if kernels is None:
        return specs
    known = [s.name for s in specs]
    unknown = [k for k in kernels if k not in known]
    if unknown:
        raise ConfigError(f"unknown kernels {unknown}; the registry has {known}")
    return [s for s in specs if s.name in kernels]


def bench_kernel(
    spec: KernelRecord, size: str, plan: MetricPlan, timers: Mapping[str, Timer] | None = None,
    pool_factory: PoolFactory = make_pool,
) -> list[CaseResult]:
    """Every case of one kernel; a failure names the case and keeps the cause."""
    chosen: Mapping[str, Timer] = timers if timers is not None else default_timers(plan)
    results: list[CaseResult] = []
    for case in kernel_cases(spec, size):
        try:
            results.extend(measure_case(case, plan, chosen, pool_factory))
        except KilnError:
            raise
        except Exception as exc:
            raise _translate(exc, f"{spec.name}/{case.name}") from exc
    return results


def _translate(exc: Exception, where: str) -> KilnError:
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError: another job holds the device
        return InfrastructureError(f"benchmark {where} ran out of device memory: {exc}")
    return BenchmarkError(f"benchmark {where} failed: {type(exc).__name__}: {exc}")


def _machine_backend() -> str:
    import torch

    return "cpu" if not torch.cuda.is_available() else ("hip" if torch.version.hip else "cuda")


def bench_skip(config: KilnConfig) -> str:
    """Why this machine's bench stage is "not run" ("" when it benchmarks a variant).

    Switched off in ``kiln.toml``, or no variant runs here (a GPU-only package on a
    machine without its GPU): the reason, never a failure of the run.
    """
    if not config.bench.enabled:
        return "not run: the bench stage is switched off ([bench] enabled = false in kiln.toml)"
    backend = _machine_backend()
    hardware = _hardware_variants(config, backend)
    if not hardware:
        have = ", ".join(f"{v.name} ({v.backend})" for v in config.variants)
        return (f"not run: no variant of kiln.toml runs on this machine ({backend}); its variants are {have}:"
                " a machine with their hardware benchmarks them ([bench] enabled = false switches the stage off)")
    if not any(_runs_here(v) for v in hardware):
        cells = ", ".join(f"{v.name} (Python {v.cell.python})" for v in hardware if v.cell is not None)
        return (f"not run: the harness measures in an environment of Kiln's interpreter (Python {_KILN_PYTHON}),"
                f" and no cell of this machine's variants is for it: {cells}")
    return ""


def no_benchmarks(config: KilnConfig) -> str:
    """Why the package has nothing to measure ("" when it may): Kiln's harness times the cases of the kernel
    registry, so a package without one (built by its own backend) declares no benchmarks, and its bench stage
    is "not run", never a failure and never an environment made for nothing."""
    if config.project.registry is None:
        return ("not run: the package declares no benchmarks (no [project] registry in kiln.toml, whose kernels'"
                " bench cases the harness times)")
    return ""


def no_bench_cases(config: KilnConfig) -> str:
    """Why the package has nothing to measure by its registry's own account ("" when a kernel declares bench
    cases, or the registry cannot be read: then the stage measures, and meets the error, as always). The build
    records which kernels declare ``bench_cases`` when it reads the registry; a build that did not (CPU variants
    only) leaves it to a read here. Either read runs in the registry's guest, never in Kiln's process; with no
    kernel declaring cases, a bench environment and a measuring server would time nothing."""
    # Kiln's side only: this module is also imported inside the bench environment, which has no build planner.
    from kiln.tasks.build.plancache import bench_kernels, store_bench_kernels
    from kiln.tasks.project.registry_guest import load_registry_data

    root = config.path(config.build.cache_dir)
    declared = bench_kernels(root, config)
    if declared is None:
        try:
            data = load_registry_data(config)
        except ConfigError as exc:
            _log.warning("could not read the registry to see which kernels declare bench cases: %s", exc)
            return ""
        declared = data.bench_kernels
        store_bench_kernels(root, config, declared, data.module_files, data.dists)
    if declared:
        return ""
    return (f"not run: no kernel declares bench cases (the registry {config.project.registry!r}): nothing to"
            " measure, so no bench environment was made")


_KILN_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _runs_here(variant: Variant) -> bool:
    """Whether Kiln's interpreter runs ``variant``'s wheel: the bench environment stands on the shared base
    (torch, Triton) and Kiln's harness, which are made for Kiln's Python only, on this machine's CPU (an
    aarch64 cell's wheel is not measured on an x86_64 machine)."""
    python = variant.cell is None or variant.cell.python is None or variant.cell.python == _KILN_PYTHON
    return python and platform.machine() in built_for(variant)


def _what_for(variant: Variant) -> str:
    """What of ``variant``'s cell keeps it from this machine's harness: its CPU, else its Python."""
    cpus = built_for(variant)
    if platform.machine() not in cpus:
        return f"{'/'.join(cpus)} (this machine is {platform.machine()})"
    return f"Python {variant.cell.python if variant.cell is not None else _KILN_PYTHON}"


def _hardware_variants(config: KilnConfig, backend: str) -> list[Variant]:
    """The variants of this machine's hardware: a GPU variant of the device's kind, else the CPU ones."""
    return ([v for v in config.variants if v.backend == backend]
            or [v for v in config.variants if v.backend == "cpu"])


def bench_variant(config: KilnConfig) -> str:
    """The variant whose wheel this machine benchmarks: a GPU variant of the device's kind, else a CPU one; of
    a Python matrix, the cell of Kiln's own Python (:func:`bench_left` names the others)."""
    backend = _machine_backend()
    chosen = next((v for v in _hardware_variants(config, backend) if _runs_here(v)), None)
    if chosen is None:
        raise ConfigError(f"no variant of kiln.toml runs on this machine ({backend}, Python {_KILN_PYTHON});"
                          " the bench stage needs one")
    return chosen.name


def bench_left(config: KilnConfig, variant: str) -> list[Unit]:
    """A "not run" unit, with the reason, for each other Python cell of ``variant``'s matrix: the stage measures
    one wheel per machine, and those cells' wheels need an interpreter the harness does not run under."""
    chosen = config.variant(variant)
    if chosen.cell is None:
        return []
    return [Unit(f"bench/{v.name}", "bench", "not_run", variant=v.name,
                 message=f"not run: the bench stage measured {variant} (Kiln's Python {_KILN_PYTHON}); this cell's"
                         f" wheel is for {_what_for(v)}, which the harness does not run under")
            for v in config.variants
            if v.cell is not None and v.cell.matrix == chosen.cell.matrix and v.name != variant and not _runs_here(v)]


def nothing_to_bench(run_id: str, variant: str, units: Iterable[Unit], artifacts: Iterable[Artifact]) -> str:
    """Why ``variant`` has nothing to benchmark in run ``run_id`` ("" when its wheel is there).

    No wheel is "not run" with this reason, never a crash: the build stage's
    own units say why it is missing, and a failed build is already a failure there.
    """
    if any(a.kind == "wheel" and a.variant == variant and a.state == "ok" for a in artifacts):
        return ""
    failed = sorted(u.id for u in units if u.stage == "build" and u.variant == variant and u.state == "failed")
    if failed:
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        return (f"not run: run {run_id} has no {variant} wheel to benchmark: its build failed "
                f"({', '.join(failed[:3])}{more})")
    return (f"not run: run {run_id} has no {variant} wheel to benchmark: the run built no {variant} wheel "
            f"(its build did not run, or built nothing for it)")


def result_variant(config: KilnConfig, plan: MetricPlan) -> str:
    """The configured variant that matches the device measured on (its name in the results)."""
    import torch

    backend = "cpu" if plan.device == "cpu" else ("hip" if torch.version.hip else "cuda")
    return next((v.name for v in config.variants if v.backend == backend), backend)


def assemble(
    config: KilnConfig, plan: MetricPlan, size: str, cases: Sequence[CaseResult], *, run_id: str, flow: str,
    created: str,
) -> BenchResults:
    """The results document, with the metadata a later comparison needs; ``created`` is the run's start as its
    record says (:func:`kiln.tasks.bench.results.iso_time`), never a clock of the measuring process."""
    return BenchResults(
        commit=git_commit(config.root), variant=result_variant(config, plan), flow=flow, run_id=run_id,
        created=created, size=size, decision_metric=plan.decision, hardware=hardware(plan.device),
        versions=library_versions(config.project.distribution), cases=tuple(cases),
    )


@dataclass(frozen=True)
class BenchSetup:
    """What one benchmark run measures: size, metric plan and the kernels, in registry order."""

    size: str
    plan: MetricPlan
    kernels: tuple[str, ...]
    empty: tuple[str, ...] = ()  # kernels that declare no cases for this size

    @property
    def devices(self) -> int:
        """GPUs one kernel's benchmark holds (slots of the device pool's concurrency limit)."""
        return 0 if self.plan.device == "cpu" else 1


def prepare(config: KilnConfig, size: str | None, metric: str, installed: bool = False,
            kernels: Sequence[str] | None = None) -> BenchSetup:
    """Validate the run's parameters before anything is measured (bad input changes nothing)."""
    import torch

    size = size or config.bench.size
    if size not in BENCH_SIZES:
        raise ConfigError(f"bench size {size!r} is not one of {list(BENCH_SIZES)}")
    plan = resolve_metric(metric, torch.cuda.is_available())
    if kernels is None:
        kernels = tuple(s.name for s in bench_specs(config, installed=installed))
    _log.info("benchmarking %d kernels, size %s, metric %s on %s", len(kernels), size, plan.decision, plan.device)
    return BenchSetup(size=size, plan=plan, kernels=tuple(kernels))
