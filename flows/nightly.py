"""The nightly flow: build → test → benchmark → publish, each stage a subflow.

GPU suites whose work pool has a ``test/gpu-tests-<pool>`` deployment are
dispatched there (flows/dispatch.py) while the local stages run, and their
units are recorded before publishing, which they gate like local suites.

Stages run with ``return_state=True`` so one stage's failure never stops the
independent ones (invariant 4): tests run even if a build unit failed, and
publishing itself decides, from the run manifest, which variants passed.
Benchmark regressions are warnings in a nightly; the release flow blocks on
them. The flow ends Failed when any unit failed, with the summary artifact
naming every failure.
"""

from __future__ import annotations

import datetime

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

from flows.bench import bench_flow
from flows.build import build_flow
from flows.dispatch import dispatch_suite, gpu_deployments, record_units
from flows.common import failure_message, markdown_report, open_run, publish_unit_table
from flows.publish import publish_flow
from flows.summary import render_markdown
from flows.test import test_flow
from tasks.config import load_config
from tasks.versioning import nightly_version


@flow(name="nightly", log_prints=True)
def nightly_flow(config_path: str = "kiln.toml", out: str = "out", version: str | None = None) -> State:
    logger = get_run_logger()
    config = load_config(config_path)
    version = version or nightly_version(config.project.version, datetime.date.today())
    open_run(out, "nightly", version)
    logger.info("nightly %s of %s → %s", version, config.project.distribution, out)

    remote = gpu_deployments(config)  # GPU suites whose pool has a deployment run there
    gpu_units = [dispatch_suite.submit(config.suites_by_name[name], deployment, out)
                 for name, deployment in remote.items()]
    stages = {
        "build": build_flow(config_path=config_path, out=out, version=version, return_state=True),
        "test": test_flow(config_path=config_path, out=out, exclude=list(remote), return_state=True),
        "bench": bench_flow(config_path=config_path, out=out, compare="last", fail_on_regression=False,
                            return_state=True),
    }
    # GPU suites gate publishing like local ones: their units are in run.json first.
    record_units(out, [future.result() for future in gpu_units])
    stages |= {
        "publish": publish_flow(config_path=config_path, out=out, channel="nightly", return_state=True),
    }
    return conclude(out, stages)


def conclude(out: str, stages: dict[str, State]) -> State:
    """Leave the summary artifacts and choose the nightly's final state."""
    run = open_run(out, "nightly")
    markdown_report("kiln-nightly-summary", render_markdown(run), f"Nightly {run.version}")
    publish_unit_table(run, run.units, "kiln-nightly-units", "Every unit of the nightly")
    failed_units = run.failed_units()
    crashed = [name for name, state in stages.items() if not state.is_completed() and not state.is_failed()]
    stage_failures = [name for name, state in stages.items() if state.is_failed()]
    if failed_units or crashed or stage_failures:
        message = failure_message("nightly", run.units) if failed_units else f"nightly: stages {stage_failures + crashed} did not complete"
        return Failed(message=message)
    return Completed(message=f"nightly {run.version}: {len(run.units)} units completed")
