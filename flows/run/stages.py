"""The stages of a run, where their units run: dispatched to a work pool, or here.

The nightly and the release share these: with a deployment for a stage's
pool on the server (:func:`kiln.flows.run.dispatch.find_deployments`) its units
go there, one flow run per variant build or suite; without one the stage's
own flow runs in this process, as on a laptop.
"""

from __future__ import annotations

from prefect import State
from prefect.futures import PrefectFuture, wait
from prefect.states import Completed, Failed

from kiln.core.manifest import Unit
from kiln.core.record import RunRecord
from kiln.flows.build import build_flow
from kiln.flows.publish import publish_flow
from kiln.flows.run.common import record, sync_state, unit_from_state
from kiln.flows.run.dispatch import Remote, dispatch_build, dispatch_publish, dispatch_suite, dispatching
from kiln.flows.run.params import RunParams
from kiln.tasks.build.stage import wheel_unit_id
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.testing.suite import targets


def build_stage(config: KilnConfig, run: RunRecord, remote: Remote, params: RunParams) -> State:
    """Every variant's build: one dispatched run per variant on the build pool, or the build flow here."""
    if remote.build is None:
        # a release's wheels are witnessed: built again with every cache bypassed, byte for byte
        return sync_state(build_flow(config_path=params.config_path, out=params.out, run_id=params.run_id,
                                     witness=run.header.flow == "release", return_state=True))
    futures = {v.name: dispatching(dispatch_build, config).submit(config, v.name, remote.build, run, params.commit)
               for v in config.variants}
    wait(list(futures.values()))
    for variant, future in futures.items():
        if not future.state.is_completed():  # retries spent: the last attempt's reason is the unit's
            record(run, unit_from_state(Unit(wheel_unit_id(variant), "build", "failed", variant=variant),
                                        future.state))
    return Completed(message=f"build: {len(futures)} variants dispatched to {remote.build}")


def start_suites(config: KilnConfig, run: RunRecord, remote: Remote, params: RunParams) -> list[PrefectFuture[object]]:
    """Dispatch every suite that has a deployment for its pool; they run while the caller goes on."""
    return [dispatching(dispatch_suite, config).submit(config, config.suites_by_name[name], deployment, run,
                                                       params.commit)
            for name, deployment in remote.suites.items()]


def wait_suites(config: KilnConfig, run: RunRecord, remote: Remote, futures: list[PrefectFuture[object]]) -> None:
    """Wait for the dispatched suites; a suite whose dispatch itself failed gets failed units."""
    for name, future in zip(remote.suites, futures, strict=True):
        future.wait()
        if not future.state.is_completed():  # retries spent on lost workers: the last reason is the units'
            for target in targets(config, [config.suites_by_name[name]]):
                record(run, unit_from_state(target.unit("failed", ""), future.state))


def publish_stage(config: KilnConfig, run: RunRecord, remote: Remote, params: RunParams) -> State:
    """Publish the nightly channel: on a CPU-pool worker when deployed, else here."""
    if remote.publish is None:
        return sync_state(publish_flow(config_path=params.config_path, out=params.out,
                                       run_id=params.run_id or "latest", channel="nightly", return_state=True))
    future = dispatching(dispatch_publish, config).submit(config, "nightly", remote.publish, run, params.commit)
    future.wait()
    why = future.state.result(raise_on_failure=False) if future.state.is_completed() else future.state.message
    if why:
        return Failed(message=f"publish: {why}")
    return Completed(message=f"published on {remote.publish}")
