"""kiln.tasks.process: the dump → SIGTERM → grace → SIGKILL → reap ladder on real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kiln.tasks.process import group_alive, run_with_deadline, signal_name, watch
from tests.runner._procs import running

# A child that leads its group, installs the stack dump, maybe starts a
# SIGTERM-ignoring grandchild, writes its pids, then does what it is told.
CHILD = r"""
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from kiln.tasks.process import install_stack_dump
dump = install_stack_dump(sys.argv[2])
mode, state = sys.argv[3], sys.argv[4]
if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "grandchild":
    subprocess.Popen([sys.executable, "-c",
        "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').write('ready'); time.sleep(3600)", state + ".gc.ready"])
    while not os.path.exists(state + ".gc.ready"):
        time.sleep(0.01)
open(state, "w").write(str(os.getpid()))
if mode == "exit":
    sys.exit(3)
def sleep_in_a_named_function():
    time.sleep(3600)
sleep_in_a_named_function()
"""
REPO = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.stacks, self.state = tmp_path / "stacks.txt", tmp_path / "state"
        self.popen = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(self.stacks), mode, str(self.state)],
                                      start_new_session=True)
        self.pid = self.popen.pid
        end = time.monotonic() + 60
        while not self.state.exists() and self.popen.poll() is None and time.monotonic() < end:
            time.sleep(0.01)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def test_normal_exit_is_not_a_timeout(tmp_path):
    result = run_with_deadline(Proc(tmp_path, "exit"), 30, grace_s=1)
    assert (result.returncode, result.timed_out, result.escalation) == (3, False, "exited")


def test_hung_child_is_dumped_then_terminated(tmp_path):
    child = Proc(tmp_path, "sleep")
    result = run_with_deadline(child, 0.5, grace_s=1, stack_path=child.stacks)
    assert (result.timed_out, result.escalation, signal_name(result.returncode)) == (True, "sigterm", "SIGTERM")
    assert "sleep_in_a_named_function" in result.stacks


def test_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    child = Proc(tmp_path, "ignore_term")
    start = time.monotonic()
    result = run_with_deadline(child, 0.2, grace_s=1, stack_path=child.stacks)
    assert (result.escalation, signal_name(result.returncode)) == ("sigkill", "SIGKILL")
    assert time.monotonic() - start >= 1.0  # it got its grace period first


def test_grandchild_ignoring_sigterm_dies_with_the_group(tmp_path):
    child = Proc(tmp_path, "grandchild")
    result = run_with_deadline(child, 0.2, grace_s=0.5, stack_path=child.stacks)
    assert result.escalation == "sigkill"  # the leader obeyed SIGTERM; its grandchild needed SIGKILL
    assert not group_alive(child.pid)
    assert not running(int(child.state.read_text()))


def test_deadline_moves_with_progress(tmp_path):
    child = Proc(tmp_path, "sleep")
    until = time.monotonic() + 1.0

    def deadline() -> float:  # keeps moving ahead for a second (a test reporting progress), then stops
        now = time.monotonic()
        return now + 0.2 if now < until else until

    result = watch(child, deadline, grace_s=0.5)
    assert result.timed_out and result.elapsed_s >= 1.0


def test_signal_names():
    assert signal_name(-11) == "SIGSEGV"
    assert signal_name(-9) == "SIGKILL"
    assert signal_name(0) is None and signal_name(1) is None and signal_name(None) is None
