"""`kiln build` as a process: it ends without Python's teardown, and loses nothing the run sent the server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.projects import copy_project

pytestmark = pytest.mark.slow


def test_kiln_build_process_exits_with_every_log_and_state_on_the_server(prefect_env, tmp_path):
    config = copy_project("tiny", tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "build", "--config", str(config), "--out", str(out),
                           "--variant", "cpu", "--version", "0.1.0.dev20261129"],
                          env=prefect_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Run in the Prefect UI:" in proc.stdout  # stdout flushed before the process ended
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_dir.name)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
        task_runs = client.read_task_runs()
    assert flow_run.state is not None and flow_run.state.is_completed()
    messages = [log.message for log in logs]
    # The last lines the run logged, sent by Prefect's log worker as the process ended.
    assert any(m.startswith("Finished in state Completed") and log.task_run_id is None
               for m, log in zip(messages, logs, strict=True))
    mine = [t for t in task_runs if t.flow_run_id == flow_run.id]
    assert mine and all(t.state is not None and t.state.is_completed() for t in mine)
