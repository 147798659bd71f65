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

from flows.common import logger, open_run, record
from release.manifest import Unit
from tasks.config import KilnConfig, Suite

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


def _unit(suite: Suite, deployment: str, flow_run, elapsed: float) -> Unit:
    state = flow_run.state
    where = f"{deployment} (flow run {flow_run.name})"
    if state is not None and state.is_completed():
        return Unit(f"test/{suite.name}", "test", "completed", suite=suite.name, required=suite.required,
                    message=f"passed on {where}", duration_s=elapsed)
    if state is None or not state.is_final():
        why = f"did not finish within {suite.deadline_s:g}s on {where}; it was left {state.name if state else 'unscheduled'}"
    else:
        why = f"{where} ended {state.name}: {state.message or ''}".rstrip(": ")
    return Unit(f"test/{suite.name}", "test", "failed", suite=suite.name, required=suite.required,
                message=why, duration_s=elapsed)


@task(name="gpu-suite", task_run_name="test/{suite.name} → {deployment}", cache_policy=NO_CACHE)
def dispatch_suite(suite: Suite, deployment: str, out: str) -> Unit:
    """Run ``suite`` on its GPU pool; its outcome as the suite's unit (recorded by the caller)."""
    start = time.monotonic()
    try:
        flow_run = run_deployment(deployment, parameters={"suites": [suite.name], "out": f"{out}/gpu/{suite.name}"},
                                  timeout=suite.deadline_s, as_subflow=True)
    except Exception as exc:  # the server refused the run: this suite's failure, not the nightly's crash
        return Unit(f"test/{suite.name}", "test", "failed", suite=suite.name, required=suite.required,
                    message=f"could not start {deployment}: {type(exc).__name__}: {exc}",
                    duration_s=time.monotonic() - start)
    return _unit(suite, deployment, flow_run, time.monotonic() - start)


@task(name="record-gpu-suites", cache_policy=NO_CACHE)
def record_units(out: str, units: list[Unit]) -> None:
    """Record dispatched suites once the local stages have saved run.json (one writer at a time)."""
    run = open_run(out, "nightly")
    for unit in units:
        record(run, unit)
