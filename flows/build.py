"""The build stage as a Prefect flow: one task run per compile unit that builds, one for all cached units.

Order and final state only; every decision is in ``kiln.tasks.build.plan`` and
``kiln.tasks.build.stage``. Prefect's result cache is off for compile units on
purpose: Kiln's content-addressed cache re-hashes every artifact it serves,
and a Prefect cache hit would skip that check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from kiln.core.manifest import Unit
from kiln.core.record import Checkout
from kiln.flows.report import progress
from kiln.flows.report.runname import current_step_name, name_this_run, run_name
from kiln.flows.run.common import (
    finish_stage,
    markdown_report,
    open_run,
    results_of,
    retry_on_retryable,
    side_reports,
    table_report,
    unwalked,
)
from kiln.tasks.build import stage as build_stage
from kiln.tasks.build import units as build_units
from kiln.tasks.build import witness as build_witness
from kiln.tasks.build.cross import check_cross_cells
from kiln.tasks.build.plan import CompileUnit, VariantPlan
from kiln.tasks.build.stage import BuildSetup
from kiln.tasks.build.units import CompileContext, UnitResult
from kiln.tasks.onboarding.advice import what_to_set
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.run import ledger

# Retries are for retryable errors only (cache drift, a lost worker); two are enough
# for a drift found mid-run: the batch is invalidated before the error is raised.
UNIT_RETRIES = 2
WITNESS_UNIT = "build/witness"
# Unit tasks wait on the compile pool's processes (one per core), so two threads a core keep every
# worker busy; more (Prefect's default is one per submitted unit, and this was 16) only contend for
# the GIL in a warm build, where every unit is Prefect's own work: 4 threads here, not 16, took a
# warm build's flow from 1.99 s to 1.89 s (medians of 5, interleaved, in one daemon-like process).
UNIT_THREADS = max(4, 2 * (os.cpu_count() or 1))


@task(name="plan-build", cache_policy=NO_CACHE)
def plan_build_task(config: KilnConfig, version: str, variants: list[str] | None, nvcc: str | None,
                    source: Checkout, store: Any = None) -> BuildSetup:
    check_cross_cells(config, variants)  # an aarch64 cell the cross path cannot build is refused, not built x86_64
    return build_stage.prepare_build(config, version, variants, nvcc, source=source, store=store)


@task(name="verify-build-cache", cache_policy=NO_CACHE)
def verify_cache_task(setup: BuildSetup) -> list[str]:
    return build_units.verify_cache(setup.plan, build_stage.unit_cache(setup))


# One task run for every unit the cache holds (a warm build's all): a task run per unit cost Prefect's
# engine, its events and its log lines each, most of a warm build's flow. The units it resolves are in
# the run's record and the build table, each "completed" with cache "hit", as this task run ended.
@task(name="cached-units", cache_policy=NO_CACHE)
def cached_units_task(units: list[CompileUnit], env: CompileContext) -> dict[str, UnitResult]:
    return build_units.cached_results(units, env)


# The run name is a template, not one ``with_options`` copy per unit: each copy re-read the task's
# source (Prefect's task key): 0.055 s for the default project's 109 units.
@task(name="compile", task_run_name="compile {unit.id}", cache_policy=NO_CACHE, retries=UNIT_RETRIES,
      retry_delay_seconds=1, retry_condition_fn=retry_on_retryable,
      on_completion=[progress.task_hook("build")], on_failure=[progress.task_hook("build")])
def compile_task(unit: CompileUnit, env: CompileContext) -> UnitResult:
    return build_units.build_unit(unit, env)


@task(name="witness", cache_policy=NO_CACHE)
def witness_task(setup: BuildSetup, wheels: list[Path]) -> Unit:
    """Every wheel built again with every cache bypassed, compared byte for byte: the witness's unit."""
    found = build_witness.witness(setup, wheels)
    return Unit(WITNESS_UNIT, "build", "completed" if found.ok else "failed", message=found.message())


@task(name="assemble-variant", cache_policy=NO_CACHE)
def assemble_task(setup: BuildSetup, variant: VariantPlan, outcomes: dict[str, Any],
                  out: str) -> build_stage.VariantOutput:
    return build_stage.assemble_variant(setup, variant, outcomes, out)


# type-ignore: the runner's future type infers as Never, which Prefect's decorator does not accept.
@flow(name="build", flow_run_name=current_step_name("build"),
      task_runner=ThreadPoolTaskRunner(max_workers=UNIT_THREADS))  # type: ignore[arg-type]
def build_flow(config_path: str = "kiln.toml", out: str = "out", version: str | None = None,
               variants: list[str] | None = None, nvcc: str | None = None, run_id: str | None = None,
               commit: str = "", witness: bool = False) -> Any:
    """Build every unit of the matrix, then one wheel per variant whose units all built.

    ``run_id`` continues a run (the nightly's); without it the build is a run
    of its own. ``version`` defaults to the nightly version of the commit.
    ``nvcc``: path of the nvcc to use (default: the one on PATH); a missing
    one skips the CUDA C++ units with a message. ``commit``: the commit the run
    names, which this checkout must be at (a build dispatched to a worker).
    ``witness``: build every wheel again with every cache bypassed and refuse the build unless each is
    byte-identical (``kiln build --witness``; a release's build always is).
    """
    config = load_config(config_path)
    run = open_run(config, "build", out, run_id=run_id, version=version, commit=commit)
    name_this_run(run_name("build", run, variants or [v.name for v in config.variants]))
    # The run's store, opened with the build step's credentials, also holds the unit cache's shared tier.
    setup = plan_build_task(config, run.header.version, variants, nvcc, run.header.source, unwalked(run.store))
    setup = build_stage.advised(setup, what_to_set)  # a failed pep517 unit names the switch it lacks
    run.record_all(build_units.skip_record(skip) for skip in setup.plan.skips)  # before any unit runs
    verify_events = verify_cache_task(unwalked(setup))
    units = setup.plan.units
    with build_stage.compile_context(setup, run.view) as env:
        cached = cached_units_task(unwalked(units), unwalked(env))
        progress.expect("build", len(units) - len(cached))  # the units that compile now, each a task run
        started = {u.id: compile_task.submit(u, unwalked(env)) for u in setup.plan.in_start_order()
                   if u.id not in cached}
        wait(list(started.values()))
        events = [*verify_events, *env.events]
    built_now = [u.id for u in units if u.id in started]
    results: list[UnitResult | BaseException] = results_of([started[uid] for uid in built_now])
    outcomes: dict[str, UnitResult | BaseException] = {**cached, **dict(zip(built_now, results, strict=True))}
    # The variants' wheels at once (each writes only its own files): hashing and copying overlap.
    # Each gets its own units' outcomes, unwalked: walking 74 results cost more than the wheel
    # (the UI's run graph then draws no edge from each compile unit to its wheel).
    assembling = [(variant, assemble_task.submit(unwalked(setup), variant,
                                                 unwalked({u.id: outcomes[u.id] for u in variant.units}),
                                                 str(run.view)))
                  for variant in setup.plan.variants]
    # The units' records are written while the wheels are assembled (neither reads the other).
    written = run.record_all(build_units.unit_record(u, outcomes[u.id]) for u in units)
    records = {u.id: r for u, r in zip(units, written, strict=True)}
    outputs = [(variant, assembled.result()) for variant, assembled in assembling]
    run.record_all(output.unit for _, output in outputs)
    built = any(kind == "wheel" for _, output in outputs for _, kind in output.files)
    # One batch for every variant: the record's writers are busy throughout, not three times ramping up.
    artifacts = run.add_artifacts((path, "build", kind, variant.name) for variant, output in outputs
                                  for path, kind in output.files)
    ledger.record_wheels(run.store, run.header, artifacts)  # what bisect may install: the build step's word alone
    if witness and built:
        wheels = [path for _, output in outputs for path, kind in output.files if kind == "wheel"]
        run.record_all([witness_task(unwalked(setup), wheels)])
    with side_reports() as report:  # sent to the server while the record is written
        report(table_report, "kiln-build", build_stage.table_rows(units, outcomes, records),
               f"Build units — run {run.run_id}")
        compiled = build_stage.compile_line(outcomes)  # translation units compiled and reused
        report(markdown_report, "kiln-build-cache", build_stage.cache_report(events, compiled), "Build cache events")
        # One writer per key: builds of other variants of the run (other workers) keep their own.
        run.set_info("build_cache_events" + "".join(f"/{v}" for v in variants or ()), events)
        if setup.remote is not None:  # what the shared tier served, refused and took (and whether it answered)
            run.set_info("build_cache_shared" + "".join(f"/{v}" for v in variants or ()),
                         setup.remote.stats.as_dict())
        if built:
            run.mark_latest()
        return finish_stage(run, "build", "Build",
                            mine=lambda u: not variants or u.variant in variants or u.id == WITNESS_UNIT)

