"""One signal stops everything (invariant 11), on real ``kiln`` processes against the session's server.

Each command starts in a session of its own (``start_new_session``), so its
process group is its own; the signal goes to the command's process only, as
``timeout`` or a CI runner sends it, so nothing but Kiln's own handling can
reach the groups its compile workers and test processes lead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.tasks.build.pool import WORKER_MODULE
from kiln.tasks.descendants import proc_table
from kiln.tasks.process import group_alive
from tests.helpers.gitrepo import git_project
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXIT_WITHIN_S = 30.0
RUN_ID = re.compile(r"flow-run/([0-9a-f-]{36})")


def _start(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", *args], cwd=cwd, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, process group) of every live descendant of ``pid``."""
    table = proc_table()
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in table:
        if entry.state != "Z":
            children.setdefault(entry.ppid, []).append((entry.pid, entry.pgrp))
    found, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child[0], []))
    return found


def _own_groups(pid: int) -> set[int]:
    """Process groups led by descendants of ``pid``: what Kiln started as groups of their own."""
    return {group for child, group in _descendants(pid) if child == group}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _flow_run_state(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        history = client.read_flow_run_states(run_id)
    return flow_run.state, [state.type.value for state in history]


def _interrupt(proc: subprocess.Popen[bytes], sig: signal.Signals, log: Path,
               condition, what: str) -> tuple[set[int], float]:
    """Wait until ``condition(pid)`` holds, send ``sig`` to the command's process alone; the groups it
    had started and the seconds it took to exit."""
    groups = until(lambda: condition(proc.pid), bool, deadline_s=600)
    assert groups, f"{what} never started:\n{log.read_text(errors='replace')[-3000:]}"
    assert proc.poll() is None, f"the command ended before it could be interrupted:\n{log.read_text()[-3000:]}"
    started = until(lambda: _own_groups(proc.pid), bool, deadline_s=5) | set(groups)
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=EXIT_WITHIN_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return started, time.monotonic() - sent


def _assert_cancelled(proc: subprocess.Popen[bytes], sig: signal.Signals, log: Path, started: set[int],
                      took_s: float) -> None:
    text = log.read_text(errors="replace")
    assert proc.returncode == 128 + sig, f"exit {proc.returncode}:\n{text[-4000:]}"
    assert took_s < EXIT_WITHIN_S, f"took {took_s:.1f} s to exit:\n{text[-4000:]}"
    assert f"cancelled by {sig.name}" in text
    # Nothing of the command's own group, nor of any group it started, is left.
    left = {group: until(lambda g=group: group_alive(g), lambda alive: not alive, deadline_s=5)
            for group in {proc.pid, *started}}
    assert not any(left.values()), f"process groups left: {[g for g, alive in left.items() if alive]}"
    match = RUN_ID.search(text)
    assert match, text[-3000:]
    state, history = until(lambda: _flow_run_state(match.group(1)), lambda s: s[0].is_final(), deadline_s=60)
    assert state.is_cancelled(), f"flow run ended {state.name}: {state.message}"
    assert "CRASHED" not in history, history


def _compile_workers(pid: int) -> set[int]:
    """Compile workers: each leads its own group from its start."""
    return {g for g in _own_groups(pid) if WORKER_MODULE in _cmdline(g)}


# A test that holds the test stage while its marker file exists (outside the repository: the
# nightly after it, of the same commit, passes at once).
HOLDING_TEST = """
import os
import time
from pathlib import Path


def test_holds_while_the_marker_exists():
    marker = Path(os.environ.get("KILN_TEST_HOLD", "/nonexistent"))
    end = time.monotonic() + 600
    while marker.exists() and time.monotonic() < end:
        time.sleep(0.1)
"""


def _with_holding_test(repo: Path) -> None:
    (repo / "tests" / "test_hold.py").write_text(HOLDING_TEST)
    config = repo / "kiln.toml"  # tests run as guests: the suite names the variable its holding test reads
    config.write_text(config.read_text().replace('paths = ["tests"]\n', 'paths = ["tests"]\npass_env = ["KILN_TEST_HOLD"]\n', 1))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return git_project("tiny", tmp_path, edit=_with_holding_test)


@pytest.fixture
def hold(tmp_path: Path) -> Path:
    marker = tmp_path / "hold"
    marker.touch()
    return marker


@pytest.fixture
def env(prefect_env: dict[str, str], hold: Path) -> dict[str, str]:
    # KILN_DAEMON=off: the command runs in this process, not in a daemon's child.
    return {**prefect_env, "KILN_DAEMON": "off", "KILN_TEST_HOLD": str(hold)}


def test_sigterm_mid_build_cancels_the_run_ends_every_group_and_the_next_build_completes(project, env, tmp_path):
    out, log = tmp_path / "out", tmp_path / "build.log"
    args = ["build", "--config", str(project), "--out", str(out), "--version", "0.1.0.dev20261203"]
    proc = _start(args, env, project.parent, log)
    started, took = _interrupt(proc, signal.SIGTERM, log, _compile_workers, "a compile worker")
    _assert_cancelled(proc, signal.SIGTERM, log, started, took)

    again = subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], cwd=project.parent, env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]


def _holding_test(pid: int) -> set[int]:
    """The test stage's groups, once the holding test runs (its job is a group of its own)."""
    groups = {g for g in _own_groups(pid) if "kiln.tasks.testing.pytest_server" in _cmdline(g)}
    return groups if len(groups) >= 2 else set()  # the fork server, and the job it forked


@pytest.mark.parametrize(("sig", "condition", "what"), [
    (signal.SIGTERM, _compile_workers, "a compile worker"),
    (signal.SIGINT, _holding_test, "the holding test's job"),
], ids=["sigterm-mid-build", "sigint-mid-test"])
def test_signal_mid_nightly_cancels_the_run_and_the_next_nightly_completes(project, env, hold, tmp_path, sig,
                                                                           condition, what):
    out, log = tmp_path / "out", tmp_path / "nightly.log"
    args = ["nightly", "--config", str(project), "--out", str(out)]
    proc = _start(args, env, project.parent, log)
    started, took = _interrupt(proc, sig, log, condition, what)
    _assert_cancelled(proc, sig, log, started, took)

    hold.unlink()

    again = subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], cwd=project.parent, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]



# A deployment run's process, as a worker runs it: the flow called directly, no ``kiln`` command line.
FLOW_PROCESS = """
import sys

from kiln.flows.build import build_flow

if __name__ == "__main__":  # the compile pool's spawned workers import this module too
    build_flow(config_path=sys.argv[1], out=sys.argv[2], version="0.1.0.dev20261203")
"""


def test_sigterm_to_a_flow_run_process_group_ends_the_groups_kiln_started(project, env, tmp_path):
    """What a worker does when a run is cancelled from the UI: SIGTERM to the flow run process's group.
    Kiln's compile workers lead groups of their own, out of that signal's reach; Kiln's handler, armed
    when the flow's module is imported, ends them."""
    script, log = tmp_path / "flow_process.py", tmp_path / "flow.log"
    script.write_text(FLOW_PROCESS)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(project), str(tmp_path / "out")],
                                cwd=project.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        workers = until(lambda: _compile_workers(proc.pid), bool, deadline_s=600)
        assert workers, f"no compile worker started:\n{log.read_text(errors='replace')[-4000:]}"
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=EXIT_WITHIN_S)
        gone = until(lambda: {g for g in workers if group_alive(g)}, lambda alive: not alive, deadline_s=5)
        assert not gone, f"groups left: {gone}\n{log.read_text(errors='replace')[-4000:]}"
        assert "ended" in log.read_text(errors="replace")  # Kiln's handler said which groups it ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
