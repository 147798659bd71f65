"""The benchmark stage: one task run per kernel, a results file, a comparison, artifacts.

Kernels are measured one after another (never concurrently: two benchmarks
sharing a device or two CPU cores measure each other). Benchmarks are not
cached. A kernel's unit fails when its benchmark crashed, or when it regressed
and ``fail_on_regression`` is set (``kiln bench --compare``, the release); the
nightly passes ``fail_on_regression=False`` and keeps regressions as warnings.

``kiln bench [--run-dir D] [--out F] [--compare BASE] [--size S] [--metric M]``
maps to ``bench_flow(out=D, results_path=F, compare=BASE, size=S, metric=M)``;
results are always written to ``D/bench/results.json`` (and also to F).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows.common import finish_stage, logger, markdown_report, open_run, record, retry_on_retryable
from flows.test import gpu_slots
from release.manifest import RunManifest
from release.store import Store
from tasks import benchhistory
from tasks.bench import BenchSetup, assemble, bench_kernel, bench_specs, prepare
from tasks.benchcompare import Comparison, KernelOutcome, compare_results, kernel_units
from tasks.benchreport import build_report
from tasks.benchresults import BenchResults, save_results
from tasks.config import KilnConfig, load_config

RESULTS = Path("bench") / "results.json"


@task(name="bench-setup", cache_policy=NO_CACHE)
def setup_task(config: KilnConfig, size: str | None, metric: str, compare: str | None) -> BenchSetup:
    benchhistory.check_compare(compare)  # a bad baseline path fails before anything is measured
    return prepare(config, size, metric)


@task(name="bench-kernel", task_run_name="bench-{kernel}", cache_policy=NO_CACHE,
      retries=1, retry_delay_seconds=5, retry_condition_fn=retry_on_retryable)
def bench_kernel_task(config: KilnConfig, kernel: str, setup: BenchSetup) -> KernelOutcome:
    started = time.monotonic()
    (spec,) = bench_specs(config, [kernel])
    with gpu_slots(setup.devices):  # a benchmark sharing its GPU with a test measures the test
        cases = bench_kernel(spec, setup.size, setup.plan)
    return KernelOutcome(kernel=kernel, cases=tuple(cases), duration_s=time.monotonic() - started)


def _outcome(kernel: str, state: State) -> KernelOutcome:
    """A failed task run becomes a failed outcome, so one kernel's crash stays one failure."""
    value = state.result(raise_on_failure=False)
    if isinstance(value, KernelOutcome):
        return value
    return KernelOutcome(kernel=kernel, error=f"{type(value).__name__}: {value}" if value else state.message or "")


@task(name="bench-results", cache_policy=NO_CACHE)
def results_task(config: KilnConfig, setup: BenchSetup, outcomes: list[KernelOutcome], run: RunManifest,
                 results_path: str | None) -> BenchResults:
    cases = [case for outcome in outcomes for case in outcome.cases]
    results = assemble(config, setup.plan, setup.size, cases, run_id=run.run_id, flow=run.flow)
    path = save_results(results, run.root / RESULTS)
    run.add_artifact(path, step="bench", kind="bench", variant=results.variant)
    run.save()
    if results_path:
        logger.info("benchmark results also written to %s", save_results(results, results_path))
    return results


@task(name="bench-compare", cache_policy=NO_CACHE)
def compare_task(config: KilnConfig, compare: str | None, results: BenchResults, store: Store | None) -> Comparison:
    baseline = benchhistory.resolve_baseline(compare, results, config, store)
    comparison = compare_results(baseline, results, config.bench.threshold)
    for regression in comparison.regressions():
        logger.warning("benchmark regression: %s", regression.describe())
    return comparison


@task(name="bench-store-history", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_on_retryable)
def store_task(config: KilnConfig, results: BenchResults, store: Store | None, enabled: bool) -> str:
    return benchhistory.store_if(enabled, store, config, results)


@task(name="bench-report", cache_policy=NO_CACHE)
def report_task(config: KilnConfig, run: RunManifest, results: BenchResults, comparison: Comparison,
                outcomes: list[KernelOutcome], store: Store | None) -> None:
    """A table artifact per kernel; the summary markdown with the speed-up and trend plots."""
    history = benchhistory.history_with(store, config, results)
    report = build_report(results, comparison, outcomes, history, run.root / RESULTS.parent, run.run_id)
    for key, (description, rows) in report.tables.items():
        _table(key, rows, description)
    for path in report.plots:
        run.add_artifact(path, step="bench", kind="other", variant=results.variant)
    run.save()
    markdown_report("kiln-bench-summary", report.markdown, f"Benchmarks — run {run.run_id}")


def _table(key: str, rows: list[dict], description: str) -> None:
    try:
        create_table_artifact(key=key, table=rows, description=description)
    except Exception as exc:  # side report only: never fails the run
        logger.warning("could not create the %s table artifact: %s", key, exc)


@flow(name="bench")
def bench_flow(
    config_path: str = "kiln.toml",
    out: str = "out",
    compare: str | None = None,
    size: str | None = None,
    metric: str = "auto",
    fail_on_regression: bool = True,
    store_history: bool = True,
    results_path: str | None = None,
) -> dict | State:
    """Benchmark every kernel; compare with ``compare`` (a results file or ``"last"``)."""
    config = load_config(config_path)
    run = open_run(out, "bench", config.project.version)
    setup = setup_task(config, size, metric, compare)
    outcomes = [_outcome(name, bench_kernel_task(config, name, setup, return_state=True))
                for name in setup.kernels]
    results = results_task(config, setup, outcomes, run, results_path)
    store = benchhistory.open_history(config, session_factory=lambda: _bench_session(config))
    comparison = compare_task(config, compare, results, store)
    for unit in kernel_units(outcomes, comparison, fail_on_regression):
        record(run, unit)
    report_task(config, run, results, comparison, outcomes, store)
    store_task(config, results, store, store_history)
    return finish_stage(run, "bench", "Benchmarks")


def _bench_session(config: KilnConfig):
    from flows.credentials import session_for  # boto3 sessions only when the store is S3

    return session_for(config, "bench")
