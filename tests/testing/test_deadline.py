"""kiln.tasks.process: the dump → SIGTERM → grace → SIGKILL → reap ladder on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kiln.tasks import process
from kiln.tasks.process import (
    PopenChild,
    dump_stacks,
    group_alive,
    run_with_deadline,
    signal_group,
    signal_name,
    terminate,
    watch,
)
from tests.helpers.procs_tree import running

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
if mode == "slow_grandchild":  # obeys SIGTERM, but takes a moment to shut down
    subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(0))); "
        "open(sys.argv[1], 'w').write('ready'); time.sleep(3600)", state + ".gc.ready"])
    while not os.path.exists(state + ".gc.ready"):
        time.sleep(0.01)
def ready():
    open(state, "w").write(str(os.getpid()))
if mode == "exit":
    ready()
    sys.exit(3)
if mode == "exit_later":
    ready()
    time.sleep(0.5)
    sys.exit(3)
def sleep_in_a_named_function():
    ready()  # from here on, a dump of this thread shows this function (the test waits for ready, then dumps)
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
    assert result.timed_out and 1.0 <= result.elapsed_s < 30


def test_signal_names():
    assert signal_name(-11) == "SIGSEGV"
    assert signal_name(-9) == "SIGKILL"
    assert signal_name(0) is None and signal_name(1) is None and signal_name(None) is None
    assert signal_name(-1) == "SIGHUP"
    assert signal_name(-99) == "signal 99"  # no such signal: named by its number, not an error


def test_a_child_that_exits_before_its_deadline_is_not_a_timeout(tmp_path):
    result = run_with_deadline(Proc(tmp_path, "exit_later"), 30, grace_s=1)
    assert (result.returncode, result.timed_out, result.escalation) == (3, False, "exited")
    assert 0 < result.elapsed_s < 30


def test_terminate_on_its_own_is_a_timeout_with_its_own_elapsed_time(tmp_path):
    child = Proc(tmp_path, "sleep")
    result = terminate(child, grace_s=1, stack_path=child.stacks)
    assert (result.timed_out, result.escalation, signal_name(result.returncode)) == (True, "sigterm", "SIGTERM")
    assert 0 <= result.elapsed_s < 30


def test_a_grandchild_that_obeys_sigterm_slowly_gets_the_grace_not_sigkill(tmp_path):
    child = Proc(tmp_path, "slow_grandchild")
    result = run_with_deadline(child, 0.2, grace_s=5, stack_path=child.stacks)
    assert result.escalation == "sigterm"  # the leader exited at once; its grandchild needed 0.3 s of the grace
    assert not group_alive(child.pid)


def test_each_dump_holds_only_its_own_stacks_and_ends_when_the_dump_stops_growing(tmp_path):
    child = Proc(tmp_path, "sleep")
    try:
        first = dump_stacks(child, child.stacks)
        start = time.monotonic()
        second = dump_stacks(child, child.stacks, window_s=120)
        elapsed = time.monotonic() - start
    finally:
        run_with_deadline(child, 0, grace_s=1)
    assert first.count("sleep_in_a_named_function") == 1
    assert second.count("sleep_in_a_named_function") == 1, second  # not the first dump again
    assert elapsed < 60, elapsed  # it stopped once the dump was complete, not at the end of the 120 s window


def test_dumping_a_child_that_is_gone_returns_nothing(tmp_path):
    child = Proc(tmp_path, "exit")
    assert child.wait(30) == 3
    assert dump_stacks(child, child.stacks) == ""


def test_a_process_that_vanishes_mid_scan_does_not_hide_the_rest_of_the_group(tmp_path, monkeypatch):
    group = os.getpgrp()  # a group that exists (signal 0 to it is harmless); its members come from the fake /proc
    gone, member = tmp_path / "100", tmp_path / "101"
    gone.mkdir()  # no stat file: the process exited between the listing and the read
    member.mkdir()
    (member / "stat").write_text(f"101 (a (b) c) S 1 {group} 999999 0 -1\n")

    class FakeProc:
        def is_dir(self) -> bool:
            return True

        def iterdir(self) -> Iterator[Path]:
            return iter([tmp_path / "self", gone, member])

    monkeypatch.setattr(process, "Path", lambda _: FakeProc())
    assert group_alive(group)
    (member / "stat").write_text(f"101 (a (b) c) Z 1 {group} 999999 0 -1\n")
    assert not group_alive(group)  # a zombie is dead
    (tmp_path / "102").mkdir()
    (tmp_path / "102" / "stat").write_text("102 no-parenthesis")  # unparsable: skipped, not an error
    (member / "stat").write_text(f"101 (a (b) c) S 1 {group} 999999 0 -1\n")

    class Reordered(FakeProc):
        def iterdir(self) -> Iterator[Path]:
            return iter([tmp_path / "102", member])

    monkeypatch.setattr(process, "Path", lambda _: Reordered())
    assert group_alive(group)


def test_a_group_that_is_not_ours_any_more_counts_as_gone(monkeypatch):
    def denied(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(process.os, "killpg", denied)
    assert signal_group(12345, signal.SIGKILL) is False
    assert group_alive(12345) is False


def test_a_child_that_writes_no_dump_costs_only_the_dump_window(tmp_path):
    stacks = tmp_path / "stacks.txt"
    stacks.write_text("")
    code = ("import signal, sys, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
            "open(sys.argv[1], 'w').write('x'); time.sleep(3600)")
    popen = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "up")], start_new_session=True)
    child = PopenChild(popen)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "up").exists() and time.monotonic() < end:
            time.sleep(0.01)
        start = time.monotonic()
        assert dump_stacks(child, stacks, window_s=0.3) == ""
        assert time.monotonic() - start < 30  # the 0.3 s window, not a wait for a dump that never comes
    finally:
        run_with_deadline(child, 0, grace_s=1)


def test_run_in_group_gives_its_child_no_stdin_even_when_kiln_holds_an_open_pipe():
    """A child that reads stdin (a registry's import, a hostile build step) gets end-of-file at once; it does not
    inherit the pipe or terminal Kiln was started with, where it would wait (or read what was meant for Kiln)."""
    read, write = os.pipe()
    saved = os.dup(0)
    try:
        os.dup2(read, 0)  # Kiln's own stdin: a pipe whose writer stays open, so reading it would block
        ladder, output = process.run_in_group(
            [sys.executable, "-c", "import sys; print('read', repr(sys.stdin.read()))"], 30)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)
    assert not ladder.timed_out and ladder.returncode == 0, output
    assert output.strip() == "read ''", output
