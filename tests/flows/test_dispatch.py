"""Suites go to their pool's deployment when the server has one, else run here."""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate

from kiln.flows.run.dispatch import DEPLOYMENT, Remote, dispatch_suite, find_deployments
from kiln.flows.test import select_suites_task
from kiln.tasks.project.config import parse_config

REPO = Path(__file__).resolve().parents[2]


def config_with_pool(pool: str, deadline_s: float = 3600):
    data = tomllib.loads((REPO / "kiln.toml").read_text())
    gpu = next(s for s in data["suites"] if s.get("gpus"))
    gpu.update(pool=pool, deadline_s=deadline_s)
    return parse_config(data, REPO)


def deploy_gpu_tests(pool: str) -> None:
    """What `prefect deploy` does for prefect.yaml's GPU entry, for a fresh pool name."""
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow_from_name("test")
        client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool,
                                 entrypoint="kiln.flows.test:test_flow")


def test_suite_without_a_deployed_pool_runs_in_the_local_test_stage(prefect_server):
    config = config_with_pool(f"absent-{uuid.uuid4().hex[:8]}")
    assert find_deployments(config) == Remote()
    local = select_suites_task.fn(config, None, None, exclude=[])
    assert "kernels-gpu" in [s.name for s in local]


def test_suite_with_a_deployed_pool_is_dispatched_and_left_out_of_the_local_stage(prefect_server):
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    config = config_with_pool(pool)
    remote = find_deployments(config)
    assert remote == Remote(suites={"kernels-gpu": DEPLOYMENT.format(flow="test", pool=pool)})
    local = select_suites_task.fn(config, None, None, exclude=list(remote.suites))
    assert "kernels-gpu" not in [s.name for s in local] and "kernels" in [s.name for s in local]


def _record(tmp_path):
    from kiln.core.record import RunHeader, create_record
    from kiln.core.store import LocalStore

    return create_record(LocalStore(tmp_path / "artifacts"), RunHeader(run_id=uuid.uuid4().hex, flow="nightly",
                                                                       version="0.1.0.dev1"), tmp_path / "out")


def _dispatched_runs(run_id: str, suite: str):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    return [r for r in runs if r.parameters.get("suites") == [suite] and r.parameters.get("run_id") == run_id]


@pytest.mark.slow
def test_dispatched_suite_with_no_worker_fails_at_its_deadline_naming_the_run(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "1")  # this machine could run the suite: it waits for the pool's worker
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    config = config_with_pool(pool, deadline_s=2)
    suite = config.suites_by_name["kernels-gpu"]
    run = _record(tmp_path)

    @flow
    def parent():
        return dispatch_suite(config, suite, DEPLOYMENT.format(flow="test", pool=pool), run)

    units = parent()

    assert [u.id for u in units] == ["test/kernels-gpu/cu130", "test/kernels-gpu/rocm"]
    for unit in units:
        assert unit.state == "failed" and unit.required
        assert f"no worker of pool '{pool}' started testing kernels-gpu within 2s" in unit.message
        assert f"prefect worker start --pool {pool}" in unit.message
    assert {u.id: u.state for u in run.units()} == {u.id: "failed" for u in units}  # recorded in the run
    dispatched = _dispatched_runs(run.run_id, "kernels-gpu")
    assert len(dispatched) == 1, "exactly one run of the GPU deployment, on this run's record"
    assert dispatched[0].state.is_cancelled(), "a run given up on is cancelled: a late worker must not start it"
    assert dispatched[0].name == "test kernels-gpu", "named for what it tests (a record outside git: no commit)"


def test_a_gpu_suite_whose_pool_has_no_live_worker_is_not_run_at_once_without_a_gpu(prefect_server, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "0")
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    config = config_with_pool(pool)  # an hour's deadline: nothing may wait for it
    run = _record(tmp_path)

    @flow
    def parent():
        return dispatch_suite(config, config.suites_by_name["kernels-gpu"], DEPLOYMENT.format(flow="test", pool=pool),
                              run)

    units = parent()

    assert {u.id: u.state for u in units} == {"test/kernels-gpu/cu130": "not_run", "test/kernels-gpu/rocm": "not_run"}
    for unit in units:
        assert unit.message.startswith(f"not run: no live worker in pool '{pool}' "
                                       f"(start one: prefect worker start --pool {pool})")
        assert "needs 1 GPU, 0 on this machine" in unit.message
    assert {u.id: u.state for u in run.units()} == {u.id: "not_run" for u in units}
    assert _dispatched_runs(run.run_id, "kernels-gpu") == [], "nothing dispatched that no worker will take"


@pytest.mark.slow
def test_a_gpu_suite_is_dispatched_without_a_gpu_here_when_its_pool_has_a_live_worker(prefect_server, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "0")
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    with get_client(sync_client=True) as client:  # a worker that heartbeats (and never polls for runs)
        client.send_worker_heartbeat(pool, "gpu-node-1", heartbeat_interval_seconds=30)
    config = config_with_pool(pool, deadline_s=2)
    run = _record(tmp_path)

    @flow
    def parent():
        return dispatch_suite(config, config.suites_by_name["kernels-gpu"], DEPLOYMENT.format(flow="test", pool=pool),
                              run)

    units = parent()

    assert {u.state for u in units} == {"failed"}, "dispatched and waited for: the live worker never started it"
    assert all(f"no worker of pool '{pool}' started testing kernels-gpu within 2s" in u.message for u in units)
    assert len(_dispatched_runs(run.run_id, "kernels-gpu")) == 1


def _deploy(flow_name: str, name: str, pool: str, entrypoint: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except Exception:
            pass
        flow_id = client.create_flow_from_name(flow_name)
        client.create_deployment(flow_id=flow_id, name=name, work_pool_name=pool, entrypoint=entrypoint)


def test_builds_cpu_suites_and_publishing_go_to_the_deployments_named_after_their_pools(prefect_server):
    build, cpu = f"build-{uuid.uuid4().hex[:8]}", f"cpu-{uuid.uuid4().hex[:8]}"
    data = tomllib.loads((REPO / "kiln.toml").read_text())
    data["pools"] = {"build": build, "cpu": cpu}
    config = parse_config(data, REPO)
    assert find_deployments(config) == Remote(), "nothing deployed for these pools: everything runs here"
    _deploy("build", build, build, "kiln.flows.build:build_flow")
    _deploy("test", cpu, cpu, "kiln.flows.test:test_flow")
    _deploy("publish", cpu, cpu, "kiln.flows.publish:publish_flow")
    remote = find_deployments(config)
    cpu_suites = {s.name for s in config.suites if s.gpus == 0}
    assert remote.build == f"build/{build}" and remote.publish == f"publish/{cpu}"
    assert remote.suites == {name: f"test/{cpu}" for name in cpu_suites}  # the GPU suite's own pool is not deployed


def test_a_checkout_at_another_commit_than_the_runs_is_refused_naming_both(tmp_path):
    from kiln.core.errors import InvalidInputError
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.runs import check_checkout
    from tests.helpers.gitrepo import commit_all, git, git_project

    config = load_config(git_project("tiny", tmp_path))
    first = git(config.root, "rev-parse", "HEAD")
    check_checkout(config, first)  # at the run's commit: fine
    check_checkout(config, "")  # a run that names no commit checks nothing
    second = commit_all(config.root, "a later commit")
    with pytest.raises(InvalidInputError) as refused:
        check_checkout(config, first)
    assert first[:12] in str(refused.value) and second[:12] in str(refused.value) and "KILN_COMMIT" in str(refused.value)
    (config.root / "kiln.toml").write_text((config.root / "kiln.toml").read_text() + "\n# edited\n")
    with pytest.raises(InvalidInputError, match="with changes to kiln.toml"):
        check_checkout(config, second)


def test_suites_on_one_gpu_node_take_its_slots_in_turn(prefect_server, monkeypatch):
    import threading
    import time

    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from kiln.flows.test import NODE_ENV, gpu_slots

    node = f"node-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=f"gpu-{node}", limit=1))
    monkeypatch.setenv(NODE_ENV, node)
    spans: list[tuple[float, float]] = []

    def suite() -> None:
        with gpu_slots(1):
            start = time.monotonic()
            time.sleep(1.0)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=suite) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(spans) == 2
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert a_end <= b_start, f"two suites held the node's one GPU at once: {spans}"


@pytest.mark.parametrize("state, lost, needle", [
    ("Completed", False, ""),
    ("Crashed", True, "worker lost while building cu130 on pool 'kiln-build': build/kiln-build (flow run r1) Crashed"),
    ("Failed", False, "build/kiln-build (flow run r1) ended Failed"),
    ("Scheduled", False, "no worker of pool 'kiln-build' started building cu130 within 5s"),
    ("Pending", False, "no worker of pool 'kiln-build' started building cu130 within 5s"),
    ("Running", False, "building cu130 did not finish within 5s on pool 'kiln-build'"),
])
def test_a_dispatched_runs_ending_names_the_pool_and_only_a_crash_is_a_lost_worker(state, lost, needle, monkeypatch):
    from types import SimpleNamespace

    from prefect import states

    from kiln.flows.run import dispatch as dispatching

    cancelled = []
    monkeypatch.setattr(dispatching, "_cancel", lambda run, why: cancelled.append(why))  # no server: records the call
    run = SimpleNamespace(id=uuid.uuid4(), name="r1", state=getattr(states, state)(message="why"))
    why, was_lost = dispatching._outcome("build/kiln-build", run, 5, "building cu130")
    assert was_lost is lost and (needle in why if needle else why == "")
    assert bool(cancelled) == (state in ("Scheduled", "Pending", "Running")), "a run given up on is cancelled"


def test_a_lost_worker_raises_the_retryable_error_and_leaves_its_reason_for_the_retry(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from prefect import states

    from kiln.core.errors import WorkerLostError, is_retryable
    from kiln.core.record import RunHeader, create_record
    from kiln.core.store import LocalStore
    from kiln.flows.run import dispatch as dispatching

    run = create_record(LocalStore(tmp_path / "a"), RunHeader(run_id="r", flow="nightly", version="0.1.0"), tmp_path / "o")
    crashed = SimpleNamespace(id=uuid.uuid4(), name="r1", state=states.Crashed(message="heartbeats stopped"))
    monkeypatch.setattr(dispatching, "run_deployment", lambda *a, **k: crashed)
    monkeypatch.setattr(dispatching, "wait_for_run", lambda run, *a, **k: run)  # no server: the run is over already
    with pytest.raises(WorkerLostError) as lost:
        dispatching.dispatch("build/kiln-build", {}, deadline_s=5, what="building cu130", commit="abc", run=run)
    assert is_retryable(lost.value) and "heartbeats stopped" in str(lost.value)
    assert run.info()[dispatching.LOST_INFO + "building cu130"] == str(lost.value)
