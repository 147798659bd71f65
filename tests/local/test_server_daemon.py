"""`kiln server`: one local Prefect server per PREFECT_HOME, started once and found by later commands.

Real processes throughout: `kiln server` in subprocesses with their own PREFECT_HOME and no
PREFECT_API_URL (what a fresh machine has), and Prefect's own `prefect server start` behind them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.flows.local import server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _kiln(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], env=env, capture_output=True,
                          text=True, timeout=server.START_TIMEOUT_S + 120)


def test_two_commands_at_once_start_one_server_that_later_commands_find_and_stop_ends(tmp_path):
    home = tmp_path / "prefect-home"
    assert _kiln(home, "server", "status").returncode == 1  # nothing runs on a fresh machine
    try:
        with ThreadPoolExecutor(2) as pool:
            starts = list(pool.map(lambda _: _kiln(home, "server", "start"), range(2)))
        for start in starts:
            assert start.returncode == 0, start.stderr
        info = server.read_state(home)
        assert info is not None and server.find_server(home) == info  # ours, and it answers our auth string
        assert all(f"pid {info.pid}," in s.stdout for s in starts)  # both commands got the same server
        assert server.ensure_server(home).pid == info.pid  # a later command finds it, starts nothing
        status = _kiln(home, "server", "status")
        assert status.returncode == 0 and str(info.pid) in status.stdout
    finally:
        stopped = _kiln(home, "server", "stop")
    assert stopped.returncode == 0 and f"pid {info.pid}" in stopped.stdout
    assert not server.alive(info.pid) and not server.alive(info.watch_pid)
    assert server.read_state(home) is None
    assert _kiln(home, "server", "status").returncode == 1


def test_a_record_of_a_dead_server_is_not_trusted(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    record = {"pid": int(dead.stdout), "port": 1, "api_url": "http://127.0.0.1:1/api", "prefect_version": "0",
              "log": str(tmp_path / "log"), "started_at": 0.0}
    (tmp_path / server.STATE_FILE).write_text(json.dumps(record))
    assert server.find_server(tmp_path) is None
    assert server.server_status(tmp_path)[1] == "stale"
