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

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

from kiln.flows.bench import bench_flow
from kiln.flows.build import build_flow
from kiln.flows.dispatch import dispatch_suite, gpu_deployments
from kiln.flows.common import failure_message, markdown_report, open_run, publish_unit_table
from kiln.flows.publish import publish_flow
from kiln.flows.summary import render_markdown
from kiln.flows.test import test_flow
from kiln.tasks.config import load_config
from kiln.release.record import RunRecord


@flow(name="nightly", log_prints=True)
def nightly_flow(config_path: str = "kiln.toml", out: str = "out", version: str | None = None) -> State:
    """Build → test (local and GPU pools) and bench → publish, all in one run record."""
    logger = get_run_logger()
    config = load_config(config_path)
    run = open_run(config, "nightly", out, version=version)
    logger.info("nightly %s of %s (commit %s) → run %s", run.header.version, config.project.distribution,
                run.header.source.commit[:12] or "none", run.run_id)
    common = {"config_path": config_path, "out": out, "run_id": run.run_id}
    stages = {"build": build_flow(**common, return_state=True)}
    remote = gpu_deployments(config)  # GPU suites whose pool has a deployment run there, on this run's wheels
    gpu_units = [dispatch_suite.submit(config, config.suites_by_name[name], deployment, run)
                 for name, deployment in remote.items()]
    stages |= {
        "test": test_flow(**common, exclude=list(remote), return_state=True),
        "bench": bench_flow(**common, compare="last", fail_on_regression=False, return_state=True),
    }
    for future in gpu_units:  # GPU suites gate publishing like local ones: their units are recorded first
        future.wait()
    stages["publish"] = publish_flow(**common, channel="nightly", return_state=True)
    return conclude(run, stages)


def conclude(run: RunRecord, stages: dict[str, State]) -> State:
    """Leave the summary artifacts and choose the nightly's final state."""
    manifest = run.manifest()
    markdown_report("kiln-nightly-summary", render_markdown(manifest), f"Nightly {manifest.version}")
    publish_unit_table(run, manifest.units, "kiln-nightly-units", "Every unit of the nightly")
    run.write_view()
    failed_units = manifest.failed_units()
    crashed = [name for name, state in stages.items() if not state.is_completed() and not state.is_failed()]
    stage_failures = [name for name, state in stages.items() if state.is_failed()]
    if failed_units or crashed or stage_failures:
        message = (failure_message("nightly", manifest.units) if failed_units
                   else f"nightly: stages {stage_failures + crashed} did not complete")
        return Failed(message=message)
    return Completed(message=f"nightly {manifest.version}: {len(manifest.units)} units completed")
