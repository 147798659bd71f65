"""The nightly flow: build → test → benchmark → publish, each stage a subflow.

Each stage's units go to the work pool of their hardware when the Prefect
server has its deployment (flows/run/dispatch.py): every variant's build to the
build pool, each suite to its pool (while the local suites and the bench run
here), publishing to the CPU pool; they meet only in the run record. A
dispatched suite's units are recorded before publishing, which they gate
like local suites.

Stages run with ``return_state=True`` so one stage's failure never stops the
independent ones (invariant 4): tests run even if a build unit failed, and
publishing itself decides, from the run manifest, which variants passed.
Benchmark regressions (the regression policy over the window of stored runs)
are warnings in a nightly; the release flow blocks on them. A failure of a
quarantined flaky test does not gate publishing (``[testing.quarantine]``);
the nightly leaves the quarantine list as the ``kiln-quarantine`` artifact.
The flow ends Failed when any unit failed, with the summary artifact naming
every failure.
"""

from __future__ import annotations

from typing import Any

from prefect import State, flow, get_run_logger
from prefect.states import Completed, Failed

from kiln.core.record import RunRecord
from kiln.flows.bench import bench_flow
from kiln.flows.publish import start_dependency_checks
from kiln.flows.report.runname import current_nightly_name, name_this_run, run_name
from kiln.flows.report.summary import render_markdown
from kiln.flows.run.common import (
    coverage_report,
    failure_message,
    markdown_report,
    open_run,
    table_report,
    unit_rows,
)
from kiln.flows.run.dispatch import find_deployments
from kiln.flows.run.params import RunParams
from kiln.flows.run.stages import build_stage, publish_stage, start_suites, wait_suites
from kiln.flows.run.waiting import cancel_dispatched_on_exit
from kiln.flows.test import quarantine_report, test_flow
from kiln.tasks import install_hint
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.promotion import FINAL_STATE_INFO
from kiln.tasks.testing.baseenv import prepare_bases
from kiln.tasks.testing.selection import FULL_INFO


@flow(name="nightly", log_prints=True, flow_run_name=current_nightly_name)
def nightly_flow(config_path: str = "kiln.toml", out: str = "out", version: str | None = None,
                 commit: str = "", full: bool = False) -> State:
    """Build → test (on each suite's pool) and bench → publish, all in one run record.

    Each stage's units go to their work pool's deployment when the server has
    one (flows/run/dispatch.py), else run here. ``commit``: the commit this run must
    build (the checkout is refused if it is elsewhere); every dispatched unit
    runs exactly the run's commit. If the nightly stops (a failure, an
    interrupt), the runs it dispatched are cancelled first. ``full``: run every test, carry none from an
    earlier run (its suites, dispatched ones too, read it from the run record).
    """
    with cancel_dispatched_on_exit("the nightly"):
        return _nightly(config_path, out, version, commit, full)


def _nightly(config_path: str, out: str, version: str | None, commit: str, full: bool = False) -> State:
    logger = get_run_logger()
    config = load_config(config_path)
    run = open_run(config, "nightly", out, version=version, commit=commit)
    name_this_run(run_name("nightly", run))
    if full:
        run.set_info(FULL_INFO, True)
    logger.info("nightly %s of %s (commit %s) → run %s", run.header.version, config.project.distribution,
                run.header.source.commit[:12] or "none", run.run_id)
    warn_below_extra_index(config, run.header.version)
    params = RunParams.of(config, run, out)
    remote = find_deployments(config)
    # The suites' test bases Kiln's interpreter can give are copied while the build runs.
    prepare_test_bases(config)
    stages = {"build": build_stage(config, run, remote, params)}
    if remote.publish is None:  # the checks publishing asks, answered while the tests run
        start_dependency_checks(run, config)
    suites = start_suites(config, run, remote, params)
    stages |= {
        "test": test_flow(config_path=params.config_path, out=params.out, run_id=params.run_id,
                          exclude=list(remote.suites), return_state=True),
        "bench": bench_flow(config_path=params.config_path, out=params.out, run_id=params.run_id, compare="last",
                            fail_on_regression=False, return_state=True),
    }
    wait_suites(config, run, remote, suites)  # dispatched suites gate publishing like local ones
    quarantine_report(config, run, return_state=True)  # a side report: the list as every suite left it
    stages["publish"] = publish_stage(config, run, remote, params)
    coverage_report(config, run, "nightly")
    return conclude(run, stages)


def prepare_test_bases(config: KilnConfig) -> None:
    """Start copying, in the background, the test bases of every suite's variants (prepare_bases: idempotent)."""
    prepare_bases((v.backend, v.build_requires) for s in config.suites for v in config.suite_variants(s))


def warn_below_extra_index(config: KilnConfig, version: str) -> dict[str, Any] | None:
    """Warn now, before hours of building, when a release on an extra index outranks this run's version.

    The same check the publish step records for the summary
    (:func:`kiln.tasks.install_hint.extra_index_check`); ``None`` when it is off or there is no extra index.
    """
    extras = list(config.publish.extra_index_urls)
    if not extras or not install_hint.checks_extra_indexes():
        return None
    check = install_hint.extra_index_check(config.project.distribution, version, extras)
    if check["state"] == "below":
        get_run_logger().warning(
            "VERSION BELOW AN EXTRA INDEX: %s %s sorts below release %s on %s, which an unpinned install takes "
            "instead; raise [project] version above %s in kiln.toml", config.project.distribution,
            check["version"], check["newest"], check["index"], check["newest"])
    return check


def conclude(run: RunRecord, stages: dict[str, State]) -> State:
    """Leave the summary artifacts and choose the nightly's final state (recorded: a promotion reads it)."""
    manifest = run.manifest()
    failed_units = manifest.failed_units()
    crashed = [name for name, state in stages.items() if not state.is_completed() and not state.is_failed()]
    stage_failures = [name for name, state in stages.items() if state.is_failed()]
    if failed_units or crashed or stage_failures:
        message = (failure_message("nightly", manifest.units) if failed_units
                   else f"nightly: stages {stage_failures + crashed} did not complete")
        final: State = Failed(message=message)
    else:
        final = Completed(message=f"nightly {manifest.version}: {len(manifest.units)} units completed")
    run.set_info(FINAL_STATE_INFO, {"state": final.type.value, "message": final.message})
    table = table_report("kiln-nightly-units", unit_rows(manifest.units), f"Every unit — run {run.run_id}")
    markdown_report("kiln-nightly-summary", render_markdown(manifest, table), f"Nightly {manifest.version}")
    run.write_view()
    return final
