"""SIGTERM to a `kiln nightly` waiting on a dispatched suite: it ends within 30 s and every run it dispatched is Cancelled.

A real ``prefect server`` has a ``test/kiln-wait`` deployment on a pool no
worker serves; the committed tiny project's CPU suite lives on that pool, so
the nightly dispatches it and waits (this machine could run the suite, so a
worker may still come: up to the suite's hour-long deadline). The suite has two
shards, so two flow runs are dispatched and waited on at once (one shard is the
one-run case of the same wait). One SIGTERM, as ``timeout`` or a CI runner sends
it, must end the command and cancel every dispatched run, so no worker that
comes up later runs one; the nightly's own run ends Cancelled (Kiln's signal
handler, :mod:`kiln.flows.run.cancel`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.gitrepo import git_project
from tests.helpers.prefect_server import PrefectServer, prefect_server_process
from tests.helpers.processes import stop
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

POOL = "kiln-wait"


def _suite_on_the_pool(repo) -> None:
    config = repo / "kiln.toml"
    text = config.read_text()
    assert 'name = "tiny"\n' in text
    config.write_text(text.replace('name = "tiny"\n', f'name = "tiny"\npool = "{POOL}"\nshards = 2\n'))


def _deploy_without_worker(server: PrefectServer):
    from prefect.client.schemas.actions import WorkPoolCreate

    with server.client() as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        flow_id = client.create_flow_from_name("test")
        deployment_id = client.create_deployment(flow_id=flow_id, name=POOL, work_pool_name=POOL,
                                                 entrypoint="kiln.flows.test:test_flow")
    return deployment_id


def _runs_of(server: PrefectServer, deployment_id) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with server.client() as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_sigterm_ends_a_nightly_waiting_on_a_dispatched_suites_shards_and_cancels_every_run(tmp_path):
    config = git_project("tiny", tmp_path, edit=_suite_on_the_pool)
    (tmp_path / "home").mkdir()
    with prefect_server_process(tmp_path / "home") as server:
        deployment_id = _deploy_without_worker(server)
        log = tmp_path / "nightly.log"
        with log.open("ab") as out:  # appended to by the command; read afresh, never through this handle
            proc = subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(config),
                                     "--out", str(tmp_path / "out")], cwd=config.parent, env=server.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            dispatched = until(lambda: _runs_of(server, deployment_id), lambda runs: len(runs) == 2, deadline_s=900)
            assert len(dispatched) == 2 and proc.poll() is None, f"not both shards dispatched to {POOL}: {_tail(log)}"
            said = until(lambda: log.read_text(errors="replace"),
                         lambda text: f"waiting for a worker of pool '{POOL}' to start testing tiny" in text,
                         deadline_s=120)
            assert f"waiting for a worker of pool '{POOL}' to start testing tiny" in said, _tail(log)  # not silent
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"kiln nightly still running 30 s after SIGTERM: {_tail(log)}")
            assert proc.returncode != 0, _tail(log)
            assert time.monotonic() - start <= 30
            runs = _runs_of(server, deployment_id)
            assert sorted(r.name.split(" @ ")[0] for r in runs) == ["test tiny shard 1/2", "test tiny shard 2/2"]
            for run in runs:
                assert run.state.is_cancelled(), f"{run.name} {run.state.name}: {run.state.message}\n{_tail(log)}"
            nightly = [r for r in _all_runs(server) if r.name.startswith("nightly ")]
            assert [r.state.name for r in nightly] == ["Cancelled"], [(r.name, r.state) for r in nightly]
        finally:
            stop(proc)


def _all_runs(server: PrefectServer) -> list:
    with server.client() as client:
        return client.read_flow_runs()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-6000:]
