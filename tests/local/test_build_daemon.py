"""Kiln's daemon: a flow command runs in a child forked from a process that imported Prefect once.

Real processes throughout: the daemon (`python -m kiln.flows.local.daemon_server`) and its clients are
subprocesses with their own state directory (``TMPDIR``). The daemon runs a reporting command
(tests/helpers/daemon_entry.py) where a test checks what the child sees, and ``kiln`` itself
where a test checks a real build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.flows.local import daemon
from kiln.flows.local.daemon_server import running
from kiln.flows.local.server import alive
from tests.helpers.daemons import REPO, daemon_env
from tests.helpers.daemons import client as _client
from tests.helpers.daemons import start_daemon as _start
from tests.helpers.projects import copy_project
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    with daemon_env() as values:
        yield values


def test_a_command_runs_in_a_child_of_the_daemon_with_the_clients_stdio_env_and_exit_status(env):
    env = {**env, "PYTHONPATH": str(REPO)}
    pid, _ = _start(env, REPO, "tests.helpers.daemon_entry:main")
    proc = _client({**env, "KILN_TEST_VALUE": "from the client"}, REPO, "echo", "3")
    out, err = proc.communicate("a line on stdin\n", timeout=120)
    assert proc.returncode == 3, err  # the child's status, not the client's 97 (in-process fallback)
    seen = json.loads(out)
    assert seen["ppid"] == pid and seen["pid"] != proc.pid
    assert seen["value"] == "from the client"  # the client's environment, not the daemon's
    assert seen["stdin"] == "a line on stdin" and seen["cwd"] == str(REPO)
    assert seen["argv"][1:] == ["echo", "3"]
    assert "to stderr" in err


def test_ctrl_c_reaches_the_command_and_a_vanished_client_ends_it(env, tmp_path):
    env = {**env, "PYTHONPATH": str(REPO)}
    _start(env, REPO, "tests.helpers.daemon_entry:main")
    for how in ("interrupt", "kill"):
        marker = tmp_path / how
        proc = _client(env, REPO, "sleep", str(marker))
        child = int(until(lambda m=marker: m.read_text() if m.exists() else "", bool, 120))
        if how == "interrupt":
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
            assert proc.returncode == 128 + signal.SIGINT  # KeyboardInterrupt in the child
        else:
            proc.kill()
            proc.wait(timeout=60)
        assert not until(lambda c=child: alive(c), lambda up: not up, 120)


def test_changed_sources_or_settings_get_another_daemon(tmp_path):
    base = dict(os.environ)
    key = daemon.daemon_key(base, str(REPO))
    assert daemon.daemon_key(base, str(REPO)) == key
    assert daemon.daemon_key({**base, "PREFECT_API_URL": "http://127.0.0.1:1/api"}, str(REPO)) != key
    assert daemon.daemon_key(base, "/") != key
    assert daemon.daemon_key({**base, "KILN_TEST_VALUE": "x"}, str(REPO)) == key  # passed on, not imported
    source = tmp_path / "flows" / "cli.py"  # a copy of Kiln's layout: the checkout's files stay untouched
    source.parent.mkdir()
    source.write_text("print('old')\n")
    key = daemon.daemon_key(base, str(REPO), root=tmp_path)
    stamp = source.stat()
    os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    assert daemon.daemon_key(base, str(REPO), root=tmp_path) != key  # an edited Kiln never runs in an old daemon


def test_without_a_daemon_a_command_runs_in_process_and_starts_one_as_it_exits(env, tmp_path):
    # The command's own work happens here, before exit: no daemon may be starting meanwhile.
    during = ("import json, os, sys; from kiln.flows.local import daemon; s = daemon.run(sys.argv[1:]); "
              "d = daemon.state_dir(); print(json.dumps(sorted(os.listdir(d)) if d.exists() else [])); "
              "sys.exit(97 if s is None else s)")
    proc = subprocess.run([sys.executable, "-P", "-c", during, "build"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 97, proc.stderr  # run() said: run it here
    assert not [name for name in json.loads(proc.stdout) if name.endswith(".log")]  # nothing spawned yet
    directory = Path(env["TMPDIR"]) / f"kiln-{os.getuid()}"
    started = until(lambda: running(directory), bool, 180)
    assert len(started) == 1, list(directory.iterdir())


def test_a_bad_idle_setting_is_named_and_the_default_kept():
    assert daemon.idle_seconds({}) == (daemon.DEFAULT_IDLE_SECONDS, "")
    assert daemon.idle_seconds({"KILN_DAEMON_IDLE_SECONDS": "2.5"}) == (2.5, "")
    for bad in ("soon", "0", "-3", "nan"):
        value, problem = daemon.idle_seconds({"KILN_DAEMON_IDLE_SECONDS": bad})
        assert value == daemon.DEFAULT_IDLE_SECONDS and f"KILN_DAEMON_IDLE_SECONDS={bad!r}" in problem


def test_kiln_build_through_the_daemon_loses_nothing_and_reports_bad_input(env, prefect_env, tmp_path):
    config = copy_project("tiny", tmp_path)
    env = {**env, "PREFECT_API_URL": prefect_env["PREFECT_API_URL"]}
    kiln = [str(Path(sys.executable).parent / "kiln")]
    args = ["build", "--config", str(config), "--out", str(tmp_path / "out"), "--variant", "cpu",
            "--version", "0.1.0.dev20261129"]
    pid, log = _start(env, tmp_path)
    started = time.time()
    proc = subprocess.run([*kiln, *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Run in the Prefect UI:" in proc.stdout
    assert f"kiln daemon {pid}: command pid" in log.read_text()  # it ran in the daemon
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir() and not p.is_symlink()]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_dir.name)
        task_runs = [t for t in client.read_task_runs() if t.flow_run_id == flow_run.id]
    assert flow_run.state is not None and flow_run.state.is_completed()  # drained before the client returned
    assert flow_run.created is not None and flow_run.created.timestamp() >= started - 5
    assert task_runs and all(t.state is not None and t.state.is_completed() for t in task_runs)
    bad = subprocess.run([*kiln, "build", "--config", str(tmp_path / "missing.toml")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert bad.returncode == 2 and "missing.toml" in bad.stderr
    assert log.read_text().count("command pid") >= 2
