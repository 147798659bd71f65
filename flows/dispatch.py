"""GPU suites run on the hardware they need: dispatched to their work pool's deployment.

A suite with ``pool = "<name>"`` in kiln.toml goes to the ``test/gpu-tests-<name>``
deployment (see prefect.yaml) when the Prefect server has it; a worker of that
GPU pool runs it and the nightly waits for the outcome, bounded by the suite's
``deadline_s``. Without such a deployment (the embedded default, a laptop) the
suite runs in the nightly's own test stage, where GPU tests skip with a reason
on a machine without GPUs.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from kiln.flows.common import logger, record
from kiln.release.manifest import Unit
from kiln.release.record import RunRecord
from kiln.tasks.config import KilnConfig, Suite
from kiln.tasks.testing.suite import targets

GPU_DEPLOYMENT = "test/gpu-tests-{pool}"


@task(name="find-gpu-deployments", cache_policy=NO_CACHE)
def gpu_deployments(config: KilnConfig) -> dict[str, str]:
    """Suite name → deployment, for the pooled suites whose GPU deployment exists."""
    found: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        for suite in config.suites:
            if suite.pool is None:
                continue
            name = GPU_DEPLOYMENT.format(pool=suite.pool)
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                logger.info("suite %s: no deployment %s on this server; it runs here", suite.name, name)
                continue
            found[suite.name] = name
    return found


def _remote_outcome(deployment: str, flow_run, suite: Suite) -> str:
    """"" when the dispatched run completed, else why its suite failed."""
    state = flow_run.state
    where = f"{deployment} (flow run {flow_run.name})"
    if state is not None and state.is_completed():
        return ""
    if state is None or not state.is_final():
        left = state.name if state else "unscheduled"
        return f"did not finish within {suite.deadline_s:g}s on {where}; it was left {left}"
    return f"{where} ended {state.name}: {state.message or ''}".rstrip(": ")


@task(name="gpu-suite", task_run_name="test/{suite.name} → {deployment}", cache_policy=NO_CACHE)
def dispatch_suite(config: KilnConfig, suite: Suite, deployment: str, run: RunRecord) -> list[Unit]:
    """Run ``suite`` on its GPU pool against this run's wheels; its units, as the record holds them.

    The dispatched flow fetches the wheels from the run record and writes its
    units and reports back to it. A suite whose run failed to start, crashed
    or ran past its deadline gets failed units naming the pool, so a lost GPU
    worker never leaves a suite looking passed.
    """
    start = time.monotonic()
    try:
        flow_run = run_deployment(deployment, parameters={"suites": [suite.name], "run_id": run.run_id},
                                  timeout=suite.deadline_s, as_subflow=True)
        why = _remote_outcome(deployment, flow_run, suite)
    except Exception as exc:  # the server refused the run: this suite's failure, not the nightly's crash
        why = f"could not start {deployment}: {type(exc).__name__}: {exc}"
    recorded = {u.id: u for u in run.units() if u.stage == "test" and u.suite == suite.name}
    units = []
    for target in targets(config, [suite]):
        unit = recorded.get(target.unit_id)
        if unit is None or why:
            unit = target.unit("failed", why or f"{deployment} recorded no result for {target.unit_id}",
                               time.monotonic() - start)
            record(run, unit)
        units.append(unit)
    return units
