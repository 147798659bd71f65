"""The forking measuring server: one interpreter start per bench stage, one child per kernel.

The server here is the real ``kiln.tasks.bench.forking.serve`` loop in a real
process, driven by the real client; only its ``measure`` is a stand-in that
can hang or crash on request (fault injection).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.core.errors import BenchmarkError, InfrastructureError
from kiln.tasks import process
from kiln.tasks.bench.forking import MeasureServer
from kiln.tasks.bench.measure import run_measure

SERVER = textwrap.dedent("""
    import json, os, signal, sys, time
    from kiln.tasks.bench.forking import serve

    def measure(kernel, out):
        if kernel == "hang":
            time.sleep(120)
        if kernel == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        print("measuring", kernel)  # goes to the child's log, never into the replies
        with open(out, "w") as f:
            json.dump({"cases": [], "pid": os.getpid(), "parent": os.getppid()}, f)
        return 0

    sys.exit(serve(sys.stdin, sys.stdout, measure))
""")


@pytest.fixture
def server(tmp_path: Path):
    server = MeasureServer([sys.executable, "-c", SERVER], tmp_path, tmp_path / "work" / "server.log")
    yield server
    server.close()


def _measure(server: MeasureServer, tmp_path: Path, kernel: str, timeout_s: float = 60.0) -> dict:
    return run_measure(sys.executable, str(tmp_path / "kiln.toml"), tmp_path / "work", size="small", metric="cpu",
                       kernel=kernel, timeout_s=timeout_s, server=server)


def test_every_kernel_is_its_own_child_of_one_server(server: MeasureServer, tmp_path: Path):
    answers = [_measure(server, tmp_path, k) for k in ("a", "b", "c")]
    assert len({a["pid"] for a in answers}) == 3
    assert len({a["parent"] for a in answers}) == 1 and answers[0]["parent"] != os.getpid()
    assert (tmp_path / "work" / "b.log").read_text() == "measuring b\n"


def test_a_crashing_kernel_fails_alone_and_the_next_forks_from_the_same_server(server: MeasureServer,
                                                                               tmp_path: Path):
    before = _measure(server, tmp_path, "a")
    with pytest.raises(InfrastructureError, match=r"benchmark of crash exited -11 without an answer"):
        _measure(server, tmp_path, "crash")
    assert _measure(server, tmp_path, "b")["parent"] == before["parent"]


def test_a_hung_kernel_is_ended_at_its_deadline_and_the_server_goes_on(server: MeasureServer, tmp_path: Path):
    before = _measure(server, tmp_path, "a")
    with pytest.raises(BenchmarkError, match=r"benchmark of hang ran past 1s; its process group was ended by"):
        _measure(server, tmp_path, "hang", timeout_s=1.0)
    assert _measure(server, tmp_path, "b")["parent"] == before["parent"]


def test_a_lost_server_is_started_again_for_the_next_kernel(server: MeasureServer, tmp_path: Path):
    first = _measure(server, tmp_path, "a")
    os.kill(first["parent"], signal.SIGKILL)
    again = _measure(server, tmp_path, "b")
    assert again["parent"] != first["parent"]
    assert json.loads((tmp_path / "work" / "b.json").read_text())["pid"] == again["pid"]


def test_a_cancellation_ends_the_server_and_the_run_starts_no_other(server: MeasureServer, tmp_path: Path):
    """The server is registered from its start, so the handler of a kiln command's SIGTERM
    (kiln.flows.run.cancel: request_cancel, then end_all) ends it; the next kernel starts nothing."""
    process.reset_cancel()
    try:
        leader = _measure(server, tmp_path, "a")["parent"]
        assert leader in process.live_groups()
        assert process.request_cancel("SIGTERM received (test)")
        ended = process.end_all()
        assert leader in ended and not process.group_alive(leader)
        with pytest.raises(process.RunCancelledError, match="the measuring server was not started"):
            _measure(server, tmp_path, "b")
        assert not (tmp_path / "work" / "b.json").exists()
    finally:
        process.reset_cancel()
