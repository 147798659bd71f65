"""CI touches only what it started: ``.ci/supervise.py`` ends the processes below it, found by PID, and no other.

Real processes throughout: the supervisor runs a command that leaves a
detached process behind (a session of its own, its parent gone, as Kiln's
local Prefect server and daemon do), while a bystander that this test starts
outside the supervisor runs the very same command line.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.waiting import until

REPO = Path(__file__).resolve().parents[2]
SUPERVISE = REPO / ".ci" / "supervise.py"
SLEEPER = [sys.executable, "-I", "-c", "import time; time.sleep(600)", "kiln-ci-supervise-test"]
# Starts SLEEPER detached (its own session), writes its pid, and exits with the status given.
DETACH = ("import subprocess, sys; p = subprocess.Popen(sys.argv[3:], start_new_session=True); "
          "open(sys.argv[1], 'w').write(str(p.pid)); sys.exit(int(sys.argv[2]))")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def supervise(*args: str, **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-I", str(SUPERVISE), *args], stderr=subprocess.PIPE, text=True,
                            **popen)  # type: ignore[call-overload]


@pytest.fixture
def bystander():
    """A process with the leftover's command line, not started under the supervisor."""
    proc = subprocess.Popen(SLEEPER)
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def test_a_detached_leftover_is_ended_and_a_bystander_with_its_command_line_is_not(tmp_path, bystander):
    pid_file = tmp_path / "pid"
    proc = supervise("--grace", "10", "--", sys.executable, "-c", DETACH, str(pid_file), "3", *SLEEPER)
    _, err = proc.communicate(timeout=120)
    leftover = int(pid_file.read_text())
    assert proc.returncode == 3  # the command's own status
    assert not running(leftover), "the detached process the command started outlived the supervisor"
    assert f"pid {leftover}: " in err  # the log names what was left running
    assert running(bystander.pid) and bystander.poll() is None


def test_past_the_deadline_the_command_is_ended_with_status_124(tmp_path):
    pid_file = tmp_path / "pid"
    proc = supervise("--deadline", "3", "--grace", "10", "--", "bash", "-c",
                     f"{shlex.join(SLEEPER)} & echo $! > {pid_file}; wait")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 124, err
    assert "ran past 3 s" in err
    assert not running(int(pid_file.read_text()))


def test_a_signal_to_the_supervisor_ends_what_the_command_started(tmp_path):
    pid_file = tmp_path / "pid"
    proc = supervise("--grace", "10", "--", "bash", "-c", f"setsid {shlex.join(SLEEPER)} & echo $! > {pid_file}; wait")
    started = until(lambda: pid_file.read_text().strip() if pid_file.exists() else "", bool, 60)
    assert started, "the command did not start its child"
    child = int(started)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not running(child)
