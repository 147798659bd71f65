"""A real Prefect server on loopback (SQLite, a free port) and its workers, for any test folder.

Everything runs as subprocesses in their own process groups with deadlines,
and is stopped (SIGTERM, then SIGKILL) when the module's tests are done.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.processes import WORKER_QUERY_S, free_port, healthy, stop

log = logging.getLogger("kiln.tests.server")
REPO = Path(__file__).resolve().parents[2]
POOL = "kiln-process"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]
    logs: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "prefect", "--no-prompt", *args]
        log.info("running %s", " ".join(command))
        proc = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """A long-running Prefect command (a worker); stopped with the server."""
        command = [sys.executable, "-m", "prefect", *args]
        log.info("starting %s", " ".join(command))
        with open(self.logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.api_url)

    def wait_final(self, flow_run_id, deadline_s: float):
        """The flow run once it reached a final state; fails the test past the deadline."""
        end = time.monotonic() + deadline_s
        with self.client() as client:
            while time.monotonic() < end:
                run = client.read_flow_run(flow_run_id)
                if run.state is not None and run.state.type.value in FINAL:
                    return run
                time.sleep(2)
        worker_log = "".join(p.read_text(errors="replace")[-3000:] for p in self.logs.glob("worker*.log"))
        pytest.fail(f"flow run {flow_run_id} not final after {deadline_s} s; worker log tail:\n{worker_log}")


def _server_env(home: Path, port: int, ui: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "kiln",
        "PREFECT_SERVER_UI_ENABLED": "true" if ui else "false",
        "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S,
    })
    return env


@contextmanager
def prefect_server_process(home: Path, ui: bool = False) -> Iterator[PrefectServer]:
    """``prefect server start`` on a free loopback port (the UI too when ``ui``), stopped afterwards."""
    for attempt in range(3):  # the free port can be taken between bind and start
        port = free_port()
        env = _server_env(home, port, ui)
        command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                   "--no-scheduler", "--no-late-runs"]
        log.info("starting %s", " ".join(command))
        with open(home / f"server-{attempt}.log", "ab") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 600  # a fresh database migrates first: minutes on a loaded machine
        while time.monotonic() < end and proc.poll() is None and not healthy(env["PREFECT_API_URL"]):
            time.sleep(0.5)
        if proc.poll() is None and healthy(env["PREFECT_API_URL"]):
            break
        stop(proc)
    else:
        pytest.fail(f"the Prefect server did not become healthy; see {home}/server-*.log")
    server = PrefectServer(env["PREFECT_API_URL"], env, home)
    try:
        yield server
    finally:
        for worker in server.procs:
            stop(worker)
        stop(proc)
