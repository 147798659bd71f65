"""Work that moves: each unit runs on the work pool of its hardware, through the run record.

A run's variant builds go to ``build/<[pools] build>``, each test suite to
``test/<its pool>`` (a GPU suite's ``pool``, else ``[pools] cpu``) and its
publishing to ``publish/<[pools] cpu>`` — when the Prefect server has that
deployment (see ``flows/scaleout.yaml``). The dispatched flow runs on a
worker of that pool, from a clone of the commit the run names (its ``commit``,
passed as the ``KILN_COMMIT`` the deployment's ``git_clone`` step reads), and
exchanges everything through the run record in the artifact store: no path
is shared between workers. Without such a deployment (the embedded default,
a laptop) the unit runs in the calling flow's process.

Before a suite is dispatched, its pool is asked for a live worker (the
workers' heartbeats): a suite that this machine could not run either (a GPU
suite, no GPU here) and whose pool has no live worker is "not run: no live
worker in pool 'kiln-gpu' (start one: …)" at once. Every other unit is
dispatched and waits for a worker of its pool, saying so every minute with
the time left (:mod:`kiln.flows.run.waiting`); if the flow that dispatched it
stops, the dispatched run is cancelled.

A dispatched run that is not over by its deadline is cancelled and its unit
fails naming the pool (no worker picked it up, or it ran too long); one whose
worker was lost (its flow run Crashed, e.g. marked so by the zombie-run
automation, ``automations/crash-lost-runs.yaml``) fails with that reason, and
is dispatched again up to ``[pools] retries`` times.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, cast

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import task_run

from kiln.core.errors import WorkerLostError
from kiln.core.manifest import Unit
from kiln.core.record import RunRecord
from kiln.flows.report.runname import run_name
from kiln.flows.run.common import logger, record, retry_on_retryable
from kiln.flows.run.waiting import Waiting, cancel_run, live_workers, no_live_worker, wait_for_run
from kiln.tasks.build.stage import wheel_unit_id
from kiln.tasks.process import check_cancelled
from kiln.tasks.project.config import KilnConfig, Suite
from kiln.tasks.testing import shards
from kiln.tasks.testing.devices import detect_gpu_count
from kiln.tasks.testing.shards import recorded_counts
from kiln.tasks.testing.suite import not_run_reason, targets

DEPLOYMENT = "{flow}/{pool}"
COMMIT_ENV = "KILN_COMMIT"  # read by the scale-out deployments' git_clone pull step
LOST_INFO = "dispatch-lost/"  # run info: why the last attempt of a unit was lost
WAITING = Waiting()  # how dispatches wait: poll every 2 s, say what they wait for every minute


@dataclass(frozen=True)
class Remote:
    """The deployments this run's units go to; an empty one runs everything here."""

    build: str | None = None
    suites: dict[str, str] = field(default_factory=dict)  # suite name → deployment
    publish: str | None = None


def _exists(client: SyncPrefectClient, name: str) -> bool:
    try:
        client.read_deployment_by_name(name)
    except ObjectNotFound:
        return False
    return True


def find_deployments(config: KilnConfig) -> Remote:
    """Which of this run's units have a deployment on the server to go to.

    A plain call, not a task run: on the SQLite-backed local server a task
    run's events, stored while the first stage's subflow run is created, made
    that creation fail with 503 (database busy) about one run in three, and
    Prefect's client waits 2 s before its retry. What it found is logged.
    """
    pools = config.pools
    with get_client(sync_client=True) as client:
        def deployed(flow: str, pool: str | None) -> str | None:
            name = DEPLOYMENT.format(flow=flow, pool=pool) if pool else None
            return name if name and _exists(client, name) else None

        suites = {s.name: d for s in config.suites if (d := deployed("test", config.suite_pool(s)))}
        remote = Remote(deployed("build", pools.build), suites, deployed("publish", pools.cpu))
    for suite in config.suites:
        if suite.name not in remote.suites:
            logger.info("suite %s: no deployment for pool %s on this server; it runs here", suite.name,
                        config.suite_pool(suite))
    logger.info("deployments: build → %s, publish → %s%s", remote.build or "here", remote.publish or "here",
                "".join(f", suite {name} → {d}" for name, d in remote.suites.items()))
    return remote


def _job_variables(commit: str) -> dict[str, Any]:
    return {"env": {COMMIT_ENV: commit}} if commit else {}


def _pool_of(deployment: str) -> str:
    return deployment.split("/", 1)[1]


def _cancel(flow_run: FlowRun, why: str) -> None:
    """A run given up on must not start later, on a worker that comes up after the deadline."""
    cancel_run(flow_run.id, flow_run.name, why)


def _outcome(deployment: str, flow_run: FlowRun, deadline_s: float, what: str) -> tuple[str, bool]:
    """("", False) when the dispatched run completed, else (why, whether its worker was lost)."""
    state, pool = flow_run.state, _pool_of(deployment)
    where = f"{deployment} (flow run {flow_run.name})"
    if state is not None and state.is_completed():
        return "", False
    if state is None or not state.is_final():
        left = state.name if state else "unscheduled"
        if state is None or state.is_scheduled() or state.is_pending():
            why = (f"no worker of pool {pool!r} started {what} within {deadline_s:g}s: {where} was left {left} "
                   f"(start one: prefect worker start --pool {pool})")
        else:
            why = f"{what} did not finish within {deadline_s:g}s on pool {pool!r}: {where} was left {left}"
        _cancel(flow_run, why)
        return why, False
    if state.is_crashed():
        return f"worker lost while {what} on pool {pool!r}: {where} Crashed: {state.message or ''}".rstrip(": "), True
    return f"{where} ended {state.name}: {state.message or ''}".rstrip(": "), False


def dispatch(deployment: str, parameters: dict[str, Any], *, deadline_s: float, what: str, commit: str,
             run: RunRecord, name: str | None = None, waiting: Waiting | None = None) -> str:
    """Run ``deployment`` (its flow run named ``name``) and wait for it: "" when it completed, else why not.

    The wait logs what it waits for every ``waiting.log_every_s``. A run
    whose worker was lost raises :class:`WorkerLostError`, which the
    dispatching task's Prefect retries (``[pools] retries``) take; every other
    ending is final (a failed build or test fails the same way twice).
    """
    check_cancelled(f"dispatching {what} to {deployment}")  # a stopping run dispatches nothing more
    try:
        # Called from sync code, so Prefect's sync-or-async function returned the flow run itself.
        flow_run = cast(FlowRun, run_deployment(deployment, parameters=parameters, job_variables=_job_variables(commit),
                                                timeout=0, as_subflow=True, flow_run_name=name))
    except Exception as exc:  # the server refused the run: this unit's failure, not the caller's crash
        return f"could not start {deployment}: {type(exc).__name__}: {exc}"
    flow_run = wait_for_run(flow_run, _pool_of(deployment), what, deadline_s, waiting or WAITING)
    why, lost = _outcome(deployment, flow_run, deadline_s, what)
    if lost:
        run.set_info(LOST_INFO + what, why)  # the retry's unit says what happened to the attempt before
        raise WorkerLostError(why)
    return why


def unrunnable_here(config: KilnConfig, suite: Suite, pool: str) -> str:
    """Why ``suite`` is not run at all: its pool has no live worker and this machine lacks its hardware; or "".

    Waiting for a worker only makes sense when one may come; a suite this
    machine could run waits for its pool's worker instead (a live worker may
    still be started within the suite's deadline).
    """
    gpus_here = detect_gpu_count()
    here = [not_run_reason(target, gpus_here) for target in targets(config, [suite])]
    if not all(here) or live_workers(pool):
        return ""
    why_not_here = here[0].removeprefix("not run: ")
    return f"not run: {no_live_worker(pool)}, and this machine cannot run it either ({why_not_here})"


def _retried(unit: Unit, run: RunRecord, what: str) -> Unit:
    """``unit``, saying so when it completed only after a lost worker's attempt."""
    attempts = task_run.run_count
    if attempts <= 1:
        return unit
    before = run.info().get(LOST_INFO + what, "a worker was lost")
    return replace(unit, message=f"{unit.message} (attempt {attempts}; before: {before})")


def dispatching(task_fn: Task[..., Any], config: KilnConfig) -> Task[..., Any]:
    """``task_fn`` with the retries ``[pools]`` allows for a lost worker (and for nothing else)."""
    return task_fn.with_options(retries=config.pools.retries, retry_delay_seconds=1,
                                retry_condition_fn=retry_on_retryable)


@task(name="build-variant", task_run_name="build/{variant} → {deployment}", cache_policy=NO_CACHE)
def dispatch_build(config: KilnConfig, variant: str, deployment: str, run: RunRecord, commit: str) -> Unit:
    """Build ``variant`` on a build-pool worker, into this run's record; the variant's wheel unit."""
    what = f"building {variant}"
    why = dispatch(deployment, {"variants": [variant], "run_id": run.run_id, "commit": commit},
                   deadline_s=config.pools.deadline_s, what=what, commit=commit, run=run,
                   name=run_name("build", run, variant))
    uid = wheel_unit_id(variant)
    recorded = {u.id: u for u in run.units()}.get(uid)
    if why or recorded is None:
        unit = Unit(uid, "build", "failed", variant=variant, message=why or f"{deployment} recorded no {uid}")
    else:
        unit = _retried(recorded, run, what)
    return record(run, unit)


@task(name="dispatch-suite", task_run_name="test/{suite.name} → {deployment}", cache_policy=NO_CACHE)
def dispatch_suite(config: KilnConfig, suite: Suite, deployment: str, run: RunRecord, commit: str = "") -> list[Unit]:
    """Run ``suite`` on its pool against this run's wheels; its units, as the record holds them.

    The dispatched flow fetches the wheels from the run record and writes its
    units and reports back to it. A sharded suite's shards are dispatched
    apart, one flow run each, so the pool's workers share them; their plan is
    pinned in the run first. A suite whose run failed to start, crashed or ran
    past its deadline gets failed units naming the pool, so a lost worker never
    leaves a suite looking passed; a shard's own failed unit keeps its message.
    """
    start = time.monotonic()
    what = f"testing {suite.name}"
    absent = unrunnable_here(config, suite, _pool_of(deployment))
    if absent:
        logger.warning("suite %s: %s", suite.name, absent)
        return [record(run, target.unit("not_run", absent, 0.0)) for target in targets(config, [suite])]
    parameters = {"suites": [suite.name], "run_id": run.run_id, "commit": commit}
    if suite.shards == 1:
        whys = {0: dispatch(deployment, parameters, deadline_s=suite.deadline_s, what=what, commit=commit, run=run,
                            name=run_name("test", run, suite.name))}
    else:
        whys = _dispatch_shards(config, suite, deployment, run, parameters, what)
    recorded = {u.id: u for u in run.units() if u.stage == "test" and u.suite == suite.name}
    units = []
    for target in targets(config, [suite], recorded_counts(run.info())):  # the shards the dispatched run chose
        unit, why = recorded.get(target.unit_id), whys.get(target.shard or min(whys), "")
        if unit is None or (why and unit.state != "failed"):
            unit = target.unit("failed", why or f"{deployment} recorded no result for {target.unit_id}",
                               time.monotonic() - start)
        units.append(record(run, _retried(unit, run, what)))
    return units


def _dispatch_shards(config: KilnConfig, suite: Suite, deployment: str, run: RunRecord, parameters: dict[str, Any],
                     what: str) -> dict[int, str]:
    """Pin ``suite``'s shard plan in the run (an "auto" count bounded by the pool's live workers), then dispatch
    each shard as its own flow run, all at once; why each did not complete, by shard ("" when it did).

    A lost worker's :class:`WorkerLostError` is raised once every shard has ended: the task's retry dispatches
    the suite's shards again."""
    bound = max(1, len(live_workers(_pool_of(deployment))))
    plan = shards.plan(run.store, config.testing.quarantine.history, targets(config, [suite]), bound)
    for key, value in shards.pin_entries(plan).items():
        run.set_info(key, value)
    count = max(t.shards for t in targets(config, [suite], plan.counts))

    def one(index: int) -> str:
        return dispatch(deployment, {**parameters, "shard": index}, deadline_s=suite.deadline_s,
                        what=f"{what} shard {index} of {count}", commit=parameters["commit"], run=run,
                        name=run_name("test", run, f"{suite.name} shard {index}/{count}"))

    with ThreadPoolExecutor(count, thread_name_prefix="kiln-shard") as pool:
        futures = {index: pool.submit(contextvars.copy_context().run, one, index) for index in range(1, count + 1)}
    lost = [f.exception() for f in futures.values() if isinstance(f.exception(), WorkerLostError)]
    if lost:
        raise cast(WorkerLostError, lost[0])
    return {index: future.result() for index, future in futures.items()}


@task(name="dispatch-publish", task_run_name="publish/{channel} → {deployment}", cache_policy=NO_CACHE)
def dispatch_publish(config: KilnConfig, channel: str, deployment: str, run: RunRecord, commit: str) -> str:
    """Publish this run on a CPU-pool worker; "" when it completed, else why not."""
    return dispatch(deployment, {"channel": channel, "run_id": run.run_id, "commit": commit},
                    deadline_s=config.pools.deadline_s, what=f"publishing {channel}", commit=commit, run=run,
                    name=run_name("publish", run, f"{channel} {run.header.version}"))
