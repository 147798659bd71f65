"""The benchmark stage: one task run per kernel, a results file, a comparison, artifacts.

Kernels are measured one after another (never concurrently: two benchmarks
sharing a device or two CPU cores measure each other). Benchmarks are not
cached. A kernel's unit fails when its benchmark crashed (its ``bench-<kernel>``
task run fails), or when it regressed on a metric that blocks and
``fail_on_regression`` is set (its ``verdict-<kernel>`` task run fails):
``kiln bench --compare`` blocks on every metric, the release only on
``[bench] blocking_metrics`` (CUDA-graph replay by default; CPU timings are
advisory). The nightly passes ``fail_on_regression=False`` and keeps
regressions as warnings. The comparison is recorded in the run (info
``bench_comparison``) for the release gate.

What is timed is the wheel the run ships: each kernel is measured by its own
process (:mod:`kiln.tasks.bench.measure`) in a fresh, isolated environment
(:mod:`kiln.tasks.testing.envs`: the variant's wheel from the run record, what
it declares, nothing of Kiln's interpreter), never the source tree. The
processes are forked from one measuring server that imported the wheel once
(:mod:`kiln.tasks.bench.forking`), so a kernel costs its measurement, not an
interpreter start.

``kiln bench [--run ID] [--run-dir D] [--results F] [--compare BASE] [--size S] [--metric M]``
maps to ``bench_flow(run_id=ID, out=D, results_path=F, compare=BASE, size=S, metric=M)``;
results are always recorded in the run as ``bench/results.json`` (and also written to F).
Without ``--run`` the wheel is built first, in the bench's own run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import State, flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from kiln.core.errors import BenchmarkError
from kiln.core.manifest import Unit
from kiln.core.record import RunRecord
from kiln.core.store import Store
from kiln.flows.build import build_flow
from kiln.flows.report import progress
from kiln.flows.report.runname import current_step_name, name_this_run, run_name
from kiln.flows.report.summary import BENCH_TREND_INFO
from kiln.flows.run.common import (
    finish_stage,
    logger,
    markdown_report,
    open_run,
    record,
    retry_on_retryable,
    store_session,
    unit_from_state,
    unwalked,
)
from kiln.flows.test import gpu_slots
from kiln.tasks.bench import history as benchhistory
from kiln.tasks.bench.compare import Comparison, KernelOutcome, compare_results, comparison_record, kernel_unit
from kiln.tasks.bench.forking import MeasureServer
from kiln.tasks.bench.harness import (
    BenchSetup,
    assemble,
    bench_left,
    bench_skip,
    bench_variant,
    no_bench_cases,
    no_benchmarks,
    nothing_to_bench,
    prepare,
)
from kiln.tasks.bench.measure import measure_server, run_measure
from kiln.tasks.bench.report import build_report
from kiln.tasks.bench.results import BenchResults, CaseResult, iso_time, load_results, save_results
from kiln.tasks.bench.window import window_cases
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.testing.envs import make_env

RESULTS = Path("bench") / "results.json"
LIST_TIMEOUT_S = 300.0     # start an interpreter, import the package and its registry
KERNEL_TIMEOUT_S = 1800.0  # every case of one kernel


@task(name="bench-env", cache_policy=NO_CACHE)
def env_task(config: KilnConfig, run: RunRecord, variant: str) -> str:
    """The interpreter of a fresh environment with ``variant``'s wheel from the run record."""
    wheels = [run.fetch(a) for a in run.artifacts() if a.kind == "wheel" and a.variant == variant]
    if not wheels:
        raise BenchmarkError(f"run {run.run_id} has no {variant} wheel to benchmark (its build failed or did not run)")
    chosen = config.variant(variant)
    return str(make_env(run.view / "bench" / ".env", wheels, indexes=config.publish.extra_index_urls,
                        backend=chosen.backend, build_requires=chosen.build_requires).python)


@task(name="bench-setup", cache_policy=NO_CACHE)
def setup_task(config: KilnConfig, size: str | None, metric: str,
               python: str, work: Path, server: MeasureServer) -> BenchSetup:
    setup = prepare(config, size, metric, kernels=())  # validates size and metric here
    listed = run_measure(python, str(config.config_file), work, size=setup.size, metric=metric, kernel=None,
                         timeout_s=LIST_TIMEOUT_S, server=server)
    return replace(setup, kernels=tuple(listed["kernels"]), empty=tuple(listed["empty"]))


@task(name="bench-kernel", task_run_name="bench-{kernel}", cache_policy=NO_CACHE,
      retries=1, retry_delay_seconds=5, retry_condition_fn=retry_on_retryable,
      on_completion=[progress.task_hook("bench")], on_failure=[progress.task_hook("bench")])
def bench_kernel_task(config: KilnConfig, kernel: str, setup: BenchSetup, python: str, work: Path,
                      metric: str, server: MeasureServer) -> KernelOutcome:
    started = time.monotonic()
    if kernel in setup.empty:
        return KernelOutcome(kernel=kernel, cases=(), duration_s=0.0)
    with gpu_slots(setup.devices):  # a benchmark sharing its GPU with a test measures the test
        answer = run_measure(python, str(config.config_file), work, size=setup.size, metric=metric, kernel=kernel,
                             timeout_s=KERNEL_TIMEOUT_S, server=server)
    cases = tuple(CaseResult.model_validate(case) for case in answer["cases"])
    return KernelOutcome(kernel=kernel, cases=cases, duration_s=time.monotonic() - started)


def _outcome(kernel: str, state: State) -> KernelOutcome:
    """A failed task run becomes a failed outcome, so one kernel's crash stays one failure."""
    value = state.result(raise_on_failure=False)
    if isinstance(value, KernelOutcome):
        return value
    return KernelOutcome(kernel=kernel, error=f"{type(value).__name__}: {value}" if value else state.message or "")


@task(name="bench-results", cache_policy=NO_CACHE)
def results_task(config: KilnConfig, setup: BenchSetup, outcomes: list[KernelOutcome], run: RunRecord,
                 results_path: str | None) -> BenchResults:
    cases = [case for outcome in outcomes for case in outcome.cases]
    results = assemble(config, setup.plan, setup.size, cases, run_id=run.run_id, flow=run.header.flow,
                       created=iso_time(run.header.created))
    path = save_results(results, run.view / RESULTS)
    run.add_artifact(path, step="bench", kind="bench", variant=results.variant)
    if results_path:
        logger.info("benchmark results also written to %s", save_results(results, results_path))
    return results


@task(name="bench-compare", cache_policy=NO_CACHE)
def compare_task(config: KilnConfig, choice: benchhistory.BaselineChoice, results: BenchResults, store: Store | None,
                 run: RunRecord, fail_on_regression: bool, blocking: list[str] | None) -> Comparison:
    """The regression policy over the stored window of comparable runs, with ``choice``'s single
    baseline for the cases whose window is too short; the trend lines go to the summary, and so do the
    history entries left out because their run records do not back them."""
    reader = benchhistory.reader_for(store, run.header)
    baseline = benchhistory.resolve_baseline(choice, results, config, reader)
    missing = choice.missing(results.variant, results.decision_metric)
    windows = () if choice.kind not in ("last", "published") else window_cases(
        benchhistory.window_history(reader, config, results), results, config.bench.regression,
        config.bench.threshold)
    comparison = compare_results(baseline, results, config.bench.threshold, missing, windows)
    for regression in comparison.regressions():
        logger.warning("benchmark regression: %s", regression.describe())
    for suspicious in comparison.suspicious():
        logger.info("benchmark suspicious (not blocking): %s", suspicious.describe())
    run.set_info("bench_comparison", comparison_record(comparison, fail_on_regression, blocking))
    ignored = reader.ignored if reader is not None else []
    if windows or ignored:
        run.set_info(BENCH_TREND_INFO, [w.trend_line() for w in windows if w.decides] + ignored)
    return comparison


@task(name="bench-verdict", task_run_name="verdict-{outcome.kernel}", cache_policy=NO_CACHE)
def verdict_task(outcome: KernelOutcome, comparison: Comparison, fail_on_regression: bool,
                 blocking: list[str] | None) -> Unit | State:
    """The kernel's unit; a regression that blocks ends this task run Failed, so the UI shows which."""
    unit = kernel_unit(outcome, comparison, fail_on_regression, blocking)
    # A Failed state, not an exception: a regression is a verdict, not a crash with a traceback.
    return Failed(message=unit.message, data=unit) if unit.state == "failed" else unit


def _kernel_unit(outcome: KernelOutcome, comparison: Comparison, fail_on_regression: bool,
                 blocking: list[str] | None) -> Unit:
    """A crashed kernel's unit comes from its failed bench task; the others from their verdict task."""
    if outcome.error:
        return kernel_unit(outcome, comparison, fail_on_regression, blocking)
    state = verdict_task(outcome, comparison, fail_on_regression, blocking, return_state=True)
    template = Unit(id=f"bench/{outcome.kernel}", stage="bench", state="failed", kernel=outcome.kernel,
                    duration_s=outcome.duration_s)
    return unit_from_state(template, state)


@task(name="bench-store-history", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_on_retryable)
def store_task(config: KilnConfig, results: BenchResults, store: Store | None, enabled: bool, run: RunRecord) -> str:
    return benchhistory.store_if(enabled, store, config, results, run.header)


@task(name="bench-report", cache_policy=NO_CACHE)
def report_task(config: KilnConfig, run: RunRecord, results: BenchResults, comparison: Comparison,
                outcomes: list[KernelOutcome], store: Store | None) -> None:
    """A table artifact per kernel; the summary markdown with the speed-up and trend plots."""
    history = benchhistory.history_with(benchhistory.reader_for(store, run.header), config, results)
    report = build_report(results, comparison, outcomes, history, run.view / RESULTS.parent, run.run_id)
    for key, (description, rows) in report.tables.items():
        _table(key, rows, description)
    for path in report.plots:
        run.add_artifact(path, step="bench", kind="other", variant=results.variant)
    markdown_report("kiln-bench-summary", report.markdown, f"Benchmarks — run {run.run_id}")


def _table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    try:
        create_table_artifact(key=key, table=rows, description=description)
    except Exception as exc:  # side report only: never fails the run
        logger.warning("could not create the %s table artifact: %s", key, exc)


@flow(name="bench", flow_run_name=current_step_name("bench"))
def bench_flow(
    config_path: str = "kiln.toml",
    out: str = "out",
    compare: str | None = None,
    size: str | None = None,
    metric: str = "auto",
    fail_on_regression: bool = True,
    store_history: bool = True,
    results_path: str | None = None,
    run_id: str | None = None,
    blocking_metrics: list[str] | None = None,
) -> dict[str, Any] | State:
    """Benchmark every kernel of the run's wheel; compare with ``compare``.

    ``compare``: a results file, ``"last"`` (the previous nightly) or ``"published:<channel>"``
    (that channel's last published release). ``blocking_metrics``: the metrics whose regressions
    fail a unit when ``fail_on_regression`` (None: every metric).
    """
    config = load_config(config_path)
    choice = benchhistory.parse_compare(compare)  # parsed once, here; a bad baseline fails before measuring
    benchhistory.check_compare(choice)
    run = open_run(config, "bench", out, run_id=run_id, step="bench")
    skipped = bench_skip(config) or no_benchmarks(config)
    if skipped:  # switched off, nothing here runs any variant, or nothing to measure: not run, with the reason
        name_this_run(run_name("bench", run))
        record(run, Unit("bench/-", "bench", "not_run", message=skipped))
        return finish_stage(run, "bench", "Benchmarks")
    variant = bench_variant(config)
    name_this_run(run_name("bench", run, variant))
    for left in bench_left(config, variant):  # the matrix's other Python cells: not run, each saying why
        record(run, left)
    if run_id is None:
        build_flow(config_path=str(config.config_file), out=out, variants=[variant], run_id=run.run_id,
                   return_state=True)
    # No wheel, or no kernel that declares cases (the registry read in its guest, by the build or here)
    nothing = nothing_to_bench(run.run_id, variant, run.units(), run.artifacts()) or no_bench_cases(config)
    if nothing:  # not run, with the reason: not a crash (the build's own units say why)
        record(run, Unit(f"bench/{variant}", "bench", "not_run", variant=variant, message=nothing))
        return finish_stage(run, "bench", "Benchmarks")
    work = run.view / "bench" / ".work"
    python = env_task(config, run, variant)
    outcomes, setup = _measure_all(config, size, metric, python, work)
    results = results_task(config, setup, outcomes, run, results_path)
    store = benchhistory.open_history(config, session_factory=lambda: store_session(config, "bench"))
    comparison = compare_task(config, choice, results, store, run, fail_on_regression, blocking_metrics)
    for outcome in outcomes:
        record(run, _kernel_unit(outcome, comparison, fail_on_regression, blocking_metrics))
    report_task(config, run, results, comparison, outcomes, store)
    store_task(config, results, store, store_history, run)
    return finish_stage(run, "bench", "Benchmarks")


def _measure_all(config: KilnConfig, size: str | None, metric: str,
                 python: str, work: Path) -> tuple[list[KernelOutcome], BenchSetup]:
    """The kernel list, then each kernel in its own task run, all forked from one measuring server."""
    server = measure_server(python, str(config.config_file), work, size=size or config.bench.size, metric=metric)
    try:
        setup = setup_task(config, size, metric, python, work, unwalked(server))
        progress.expect("bench", len(setup.kernels))
        return [_outcome(name, bench_kernel_task(config, name, setup, python, work, metric, unwalked(server),
                                                 return_state=True))
                for name in setup.kernels], setup
    finally:
        server.close()


@task(name="keep-release-baseline", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_on_retryable)
def store_release_baseline(config: KilnConfig, run: RunRecord, channel: str) -> str:
    """Keep a published release's benchmark results as the baseline of ``channel``'s next release.

    With the release publisher's credentials: no other step's policy may write ``published/``
    (release/stores/policies.py),
    and :func:`kiln.tasks.bench.history.store_results` keeps only a release run's own results there."""
    recorded = [a for a in run.artifacts() if a.kind == "bench" and a.path == RESULTS.as_posix()]
    if not recorded:
        return "no benchmark results in this run to keep as the next release's baseline"
    results = load_results(run.fetch(recorded[0]))
    store = benchhistory.open_history(config, session_factory=lambda: store_session(config, "publish-release"))
    if store is None:
        raise BenchmarkError("the artifact store could not be opened to keep this release's benchmark baseline")
    key = benchhistory.store_results(store, config, results, run.header, channel=channel)
    return f"benchmark results kept as the {channel} channel's next baseline ({key})"


