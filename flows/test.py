"""The test stage: each configured suite is its own task run, tests isolated inside it.

A suite's tests run in their own processes (tasks.isolate) with deadlines;
infrastructure failures are retried there, per test, so the task itself is
not retried (a whole-suite retry would rerun real failures). Suites run
concurrently; one that needs GPUs first takes that many slots of the device
pool's Prefect concurrency limit, so suites on one machine never oversubscribe
it. Tests are never cached.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.states import State

from flows.common import finish_stage, logger, open_run, record
from release.manifest import RunManifest, Unit
from tasks.changes import suites_to_run
from tasks.config import KilnConfig, Suite, load_config
from tasks.isolate import RunOptions
from tasks.testsuite import SuiteRun, check_overrides, run_suite, suite_options, write_combined

# The Prefect concurrency limit that stands for this machine's GPUs; a GPU
# work pool's workers share it (create it with `prefect gcl create gpu-local --limit N`).
DEVICE_POOL = "local"


def gpu_slots(n: int) -> AbstractContextManager[object]:
    """Hold ``n`` slots of the device pool's limit; CPU-only suites need no limit to exist."""
    return concurrency(f"gpu-{DEVICE_POOL}", occupy=n) if n > 0 else nullcontext()


@task(name="test-plan", cache_policy=NO_CACHE)
def plan_task(config: KilnConfig, config_path: str, suites: list[str] | None, changed_since: str | None,
              exclude: list[str] | None = None) -> list[Suite]:
    chosen = suites_to_run(config, suites, changed_since, Path(config_path).name)
    return [suite for suite in chosen if suite.name not in (exclude or ())]


@task(name="test-suite", task_run_name="test/{suite.name}", cache_policy=NO_CACHE)
def suite_task(config: KilnConfig, suite: Suite, out: str, options: RunOptions) -> SuiteRun:
    with gpu_slots(options.gpus or 0):
        return run_suite(config, suite, out, options)


@task(name="test-reports", cache_policy=NO_CACHE)
def reports_task(run: RunManifest, runs: list[SuiteRun], junit: str | None, json_path: str | None) -> None:
    for suite_run in runs:
        record(run, suite_run.unit)
        for path in suite_run.reports:
            run.add_artifact(path, step="test", kind="report")
    for path in write_combined(runs, junit, json_path):
        logger.info("test report written to %s", path)
    run.save()


def _suite_run(suite: Suite, state: State) -> SuiteRun:
    """A crashed suite task becomes a failed unit: one suite's crash stays one failure."""
    value = state.result(raise_on_failure=False)
    if isinstance(value, SuiteRun):
        return value
    message = f"the suite did not run: {type(value).__name__}: {value}" if value else state.message or "crashed"
    unit = Unit(id=f"test/{suite.name}", stage="test", state="failed", suite=suite.name, message=message,
                required=suite.required)
    return SuiteRun(suite.name, (), unit, (), 0.0)


@flow(name="test")
def test_flow(config_path: str = "kiln.toml", out: str = "out", suites: list[str] | None = None,
              isolate: str = "test", timeout: float | None = None, retries: int = 1, junit: str | None = None,
              json_path: str | None = None, changed_since: str | None = None,
              pytest_args: list[str] | None = None, exclude: list[str] | None = None):
    """Run the config's test suites, each test isolated with a deadline; Failed if any suite failed.

    ``exclude`` names suites that run elsewhere (the nightly dispatches GPU suites to their pool).
    """
    config = load_config(config_path)
    check_overrides(isolate, timeout, retries)  # bad input fails before anything is written
    selected = plan_task(config, config_path, suites, changed_since, exclude)
    run = open_run(out, "test", config.project.version)
    futures = {
        suite.name: suite_task.submit(config, suite, out, suite_options(
            config, suite, isolate=isolate, timeout=timeout, retries=retries, pytest_args=pytest_args or ()))
        for suite in selected
    }
    for future in futures.values():
        future.wait()
    runs = [_suite_run(suite, futures[suite.name].state) for suite in selected]
    reports_task(run, runs, junit, json_path)
    return finish_stage(run, "test", "Tests")
