"""The test stage: each (suite, variant) is its own task run, tests isolated inside it.

Every suite runs against its variant's wheel from the run record, installed
in a fresh environment (:mod:`kiln.tasks.testing.envs`), never against the
checkout. ``kiln test`` without ``--run`` builds the wheels it needs first,
as part of its own run. A suite's tests run in their own processes with
deadlines; infrastructure failures are retried there, per test, so the task
itself is not retried (a whole-suite retry would rerun real failures).
Suites run concurrently; one that needs GPUs first takes that many slots of
the device pool's Prefect concurrency limit, so suites on one machine never
oversubscribe it. A suite that cannot run here is recorded ``not_run``.
Tests are never cached.
"""

from __future__ import annotations

import os
import platform
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import cast

from prefect import State, flow, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.states import Failed

from kiln.core.record import RunRecord, load_info
from kiln.flows.build import build_flow
from kiln.flows.report import progress
from kiln.flows.report.runname import current_step_name, name_this_run, run_name
from kiln.flows.report.summary import QUARANTINE_INFO, SELECTION_SUMMARY_INFO, TEST_TABLE_INFO
from kiln.flows.run.common import artifact_key, finish_stage, logger, open_run, record, table_report, unit_from_state
from kiln.flows.run.params import SuiteOptions
from kiln.tasks.project.config import KilnConfig, Suite, load_config
from kiln.tasks.testing import quarantine, shards
from kiln.tasks.testing.changes import suites_to_run
from kiln.tasks.testing.devices import detect_gpu_count
from kiln.tasks.testing.emulated import emulates, run_emulated_suite
from kiln.tasks.testing.jobs import Isolation, RunOptions
from kiln.tasks.testing.provenance import RunRecords, check_list
from kiln.tasks.testing.reports import problem_rows
from kiln.tasks.testing.selection import FULL_INFO, selector_for
from kiln.tasks.testing.suite import (
    ADHOC,
    SuiteRun,
    SuiteTarget,
    adhoc_suite,
    check_overrides,
    not_run_reason,
    run_suite,
    suite_options,
    targets,
    write_combined,
)

# The Prefect concurrency limit that stands for one GPU node's GPUs, ``gpu-<node>``: every worker
# on the node shares it (`prefect gcl create gpu-<node> --limit <GPUs>`). The node is named by the
# worker's KILN_GPU_NODE (one machine: "local").
NODE_ENV = "KILN_GPU_NODE"
DEFAULT_OPTIONS = SuiteOptions()  # each suite as kiln.toml says (frozen: one shared default is safe)


def gpu_slots(n: int) -> AbstractContextManager[object]:
    """Hold ``n`` slots of this node's GPU limit; CPU-only suites need no limit to exist."""
    node = os.environ.get(NODE_ENV, "local")
    return concurrency(f"gpu-{node}", occupy=n) if n > 0 else nullcontext()


@task(name="test-plan", cache_policy=NO_CACHE)
def select_suites_task(config: KilnConfig, suites: list[str] | None, changed_since: str | None,
                       exclude: list[str] | None = None, paths: list[str] | None = None) -> list[Suite]:
    """The configured suites to run; or, given ``paths``, one ad-hoc suite of those paths alone."""
    if paths:
        return [adhoc_suite(config, paths)]
    chosen = suites_to_run(config, suites, changed_since, config.config_file.name)
    return [suite for suite in chosen if suite.name not in (exclude or ())]


@task(name="test-wheels", cache_policy=NO_CACHE)
def wheels_task(run: RunRecord) -> dict[str, Path]:
    """Each variant's wheel from the run record, fetched into the local view and verified."""
    return {a.variant: run.fetch(a) for a in run.artifacts() if a.kind == "wheel" and a.variant}


@task(name="test-suite-emulated", task_run_name="{target.unit_id} (emulated)", cache_policy=NO_CACHE,
      on_completion=[progress.task_hook("test")], on_failure=[progress.task_hook("test")])
def emulated_suite_task(config: KilnConfig, target: SuiteTarget, wheel: Path, view: str) -> SuiteRun | State:
    """Run one aarch64 cell's suite under emulation (:mod:`kiln.tasks.testing.emulated`); Failed if it failed."""
    suite_run = run_emulated_suite(config, target, wheel, view, config.publish.extra_index_urls)
    if suite_run.unit.state == "failed":
        return Failed(message=f"{target.unit_id}: {suite_run.unit.message}", data=suite_run)
    return suite_run


@task(name="test-suite", task_run_name="{target.unit_id}", cache_policy=NO_CACHE,
      on_completion=[progress.task_hook("test")], on_failure=[progress.task_hook("test")])
def suite_task(config: KilnConfig, target: SuiteTarget, wheel: Path, view: str, options: RunOptions,
               run: RunRecord, full: bool = False) -> SuiteRun | State:
    """Run one suite; its table of problem tests is this task run's artifact.

    Its tests' outcomes go into the history, and a failure of a quarantined test does not fail it
    (:mod:`kiln.tasks.testing.quarantine`). A failed suite ends the task run Failed (red in the UI)
    with the suite run as its data, so the flow still records its reports and the unit it stands for.
    """
    selector = None if target.suite.name == ADHOC else selector_for(
        config, run.store, suite=target.suite.name, gpus=target.suite.gpus, unit_id=target.unit_id,
        unit_name=target.name, folder=target.suite_name, run_id=run.run_id, created=run.header.created,
        flow=run.header.flow, full=full or bool(load_info(run.store, run.run_id, FULL_INFO)), settles=target.shard <= 1)
    with gpu_slots(options.gpus or 0):
        suite_run = run_suite(config, target, [wheel], view, options, selector)
    if suite_run.selection is not None:
        run.set_info(f"{SELECTION_SUMMARY_INFO}{target.unit_id}", suite_run.selection.summary(target.unit_id))
        if suite_run.selection.misses:  # a recall miss is a failed unit of its own, loud in the summary
            record(run, replace(target.unit("failed", suite_run.selection.lines[0]), id=f"{target.unit_id}/recall"))
    source = run.header.source
    judged = quarantine.judge_suite(run.store, config.testing.quarantine, run_id=run.run_id,
                         commit=source.commit if source.clean else "", created=run.header.created,
                         unit_name=target.name, unit=suite_run.unit, results=suite_run.results)
    suite_run = replace(suite_run, unit=judged.unit)
    if judged.lines:
        run.set_info(f"{QUARANTINE_INFO}{target.unit_id}", list(judged.lines))
    rows = problem_rows(suite_run.results)
    url = table_report(artifact_key("kiln-tests", target.name), rows,
                       f"{target.unit_id}: {suite_run.unit.message} — failed, errored, timed-out and flaky tests "
                       f"(run {run.run_id})")
    run.set_info(f"{TEST_TABLE_INFO}{target.unit_id}", {"url": url, "problems": len(rows),
                                                       "summary": suite_run.unit.message})
    if suite_run.unit.state == "failed":
        return Failed(message=suite_run.unit.message, data=suite_run)
    return suite_run


@task(name="test-shards", cache_policy=NO_CACHE)
def shard_plan_task(config: KilnConfig, selected: list[Suite], run: RunRecord, shard: int = 0) -> shards.ShardPlan:
    """The durations each sharded suite is split by, read once for all its shards; each "auto" suite's count,
    bounded by [build] jobs (the units this machine runs at once) and recorded in the run for its dispatcher.
    One shard dispatched on its own (``shard``) takes the plan its dispatcher pinned in the run instead."""
    if shard:
        return shards.pinned(run.info())
    plan = shards.plan(run.store, config.testing.quarantine.history, targets(config, selected), config.build.jobs)
    for unit_id, count in plan.counts.items():
        run.set_info(f"{shards.SHARDS_INFO}{unit_id}", count)
    return plan


@task(name="test-durations", cache_policy=NO_CACHE)
def durations_task(config: KilnConfig, run: RunRecord, ran: list[tuple[SuiteTarget, SuiteRun]]) -> None:
    """Each test's duration in this run, for the next partition of its suite into shards."""
    shards.record_runs(run.store, config.testing.quarantine.history, ran)


@task(name="quarantine-report", cache_policy=NO_CACHE)
def quarantine_report(config: KilnConfig, run: RunRecord) -> int:
    """The quarantine list as it stands after this run's suites, the entries its run records back: a table
    artifact in the Prefect UI."""
    stored = quarantine.read_quarantine(run.store, config.testing.quarantine)
    listed = quarantine.rows(check_list(RunRecords(run.store), stored)[0])
    table_report("kiln-quarantine", listed or [{"unit": "", "test": "(none quarantined)", "why": "", "since run": "",
                                                "since": ""}],
                 f"Quarantined tests after run {run.run_id}: they run, are reported, and do not gate publishing")
    return len(listed)


@flow(name="test", flow_run_name=current_step_name("test"))
def test_flow(config_path: str = "kiln.toml", out: str = "out", suites: list[str] | None = None,
              options: SuiteOptions = DEFAULT_OPTIONS, changed_since: str | None = None,
              exclude: list[str] | None = None, run_id: str | None = None, paths: list[str] | None = None,
              commit: str = "", shard: int = 0) -> dict[str, int] | State:
    """Run the config's test suites against the run's wheels; Failed if any suite failed.

    ``run_id`` tests the wheels of that run (the nightly's, or ``kiln test --run``);
    without it the wheels are built first, in this run. ``exclude`` names suites
    that run elsewhere (the nightly dispatches GPU suites to their pool).
    ``paths`` (``kiln test -- PATHS``, relative to the project) run as one ad-hoc
    suite instead of the configured ones; ``options`` (:class:`~kiln.flows.run.params.SuiteOptions`): how they run.
    ``commit``: the commit the run names, which this checkout must be at (a suite dispatched to a worker).
    ``shard``: run only that shard (1-based) of each sharded suite, and an unsharded one's whole as shard 1: one
    of a suite's shards dispatched on its own, split by the plan its dispatcher pinned in run ``run_id``.
    """
    if shard < 0 or (shard and run_id is None):
        raise ValueError(f"shard={shard}: a shard is 1 or more, and is run only within a run (run_id) whose "
                         "dispatcher pinned its plan")
    config = load_config(config_path)
    check_overrides(options.isolate, options.timeout, options.retries)  # bad input fails before anything is written
    selected = select_suites_task(config, suites, changed_since, exclude, paths)
    run = open_run(config, "test", out, run_id=run_id, step="test", commit=commit)
    plan = shard_plan_task(config, selected, run, shard)
    chosen = targets(config, selected, plan.counts)
    if shard:
        chosen = [t for t in chosen if t.shard == shard or (t.shard == 0 and shard == 1)]
    of = f" shard {shard}/{max((t.shards for t in chosen), default=1)}" if shard else ""  # as its dispatcher named it
    name_this_run(run_name("test", run, [f"{suite.name}{of}" for suite in selected] or ["no suites"]))
    if run_id is None:
        needed = sorted({t.variant.name for t in chosen if not not_run_reason(t, detect_gpu_count())})
        if needed:
            build_flow(config_path=str(config.config_file), out=out, variants=needed, run_id=run.run_id,
                       return_state=True)
    wheels = wheels_task(run)
    gpus_here = detect_gpu_count()
    futures = {}
    for target in chosen:
        reason = not_run_reason(target, gpus_here)
        if reason:
            record(run, target.unit("not_run", reason))
            continue
        if target.variant.name not in wheels:  # its build failed: that unit already fails the run
            record(run, target.unit("skipped", f"no {target.variant.name} wheel in run {run.run_id} to test"))
            continue
        if emulates(target, platform.machine()):  # an aarch64 cell's suite that asks to run under emulation
            futures[target.unit_id] = (target, emulated_suite_task.submit(config, target, wheels[target.variant.name],
                                                                          str(run.view)))
            continue
        chosen_options = suite_options(config, target.suite, isolate=cast(Isolation, options.isolate),
                                       timeout=options.timeout, retries=options.retries,
                                       pytest_args=options.pytest_args or ())
        chosen_options = replace(chosen_options, pick=shards.compose(chosen_options.pick, plan.picker(target)))
        futures[target.unit_id] = (target, suite_task.submit(config, target, wheels[target.variant.name],
                                                             str(run.view), chosen_options, run, options.full))
    progress.expect("test", len(futures))
    runs, ran = [], []
    for target, future in futures.values():
        future.wait()
        final = future.state
        value = final.result(raise_on_failure=False) if final.is_completed() or final.is_failed() else None
        if isinstance(value, SuiteRun):
            runs.append(value)
            ran.append((target, value))
            for path in value.reports:
                run.add_artifact(path, step="test", kind="report", variant=target.variant.name)
        record(run, value.unit if isinstance(value, SuiteRun) else unit_from_state(target.unit("failed", ""),
                                                                                     future.state))
    durations_task(config, run, ran)
    for path in write_combined(runs, options.junit, options.json_path):
        logger.info("test report written to %s", path)
    names, own = {suite.name for suite in selected}, {t.unit_id for t in chosen}
    if shard:  # the suite's other shards are other flow runs' units (a recall unit is its shard's)
        return finish_stage(run, "test", "Tests", mine=lambda u: u.id in own or u.id.rsplit("/", 1)[0] in own)
    return finish_stage(run, "test", "Tests", mine=lambda u: u.suite in names)
