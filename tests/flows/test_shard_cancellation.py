"""One SIGTERM stops every shard of a suite: the shards are task runs of one ``kiln test`` flow run, so the signal
that cancels it ends each shard's fork server and test job (the pattern of :mod:`tests.flows.test_cancellation`)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.flows.test_cancellation import _assert_cancelled, _cmdline, _interrupt, _own_groups, _start
from tests.helpers.gitrepo import git_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Two tests that hold while the marker exists; split into two shards without history, one lands in each.
HOLDING = """
import os
import time
from pathlib import Path


def _hold():
    marker = Path(os.environ.get("KILN_TEST_HOLD", "/nonexistent"))
    end = time.monotonic() + 600
    while marker.exists() and time.monotonic() < end:
        time.sleep(0.1)


def test_holds_in_shard_one():
    _hold()


def test_holds_in_shard_two():
    _hold()
"""

HELD_SUITE = """
[[suites]]
name = "held"
paths = ["held"]
shards = 2
pass_env = ["KILN_TEST_HOLD"]
"""


def _with_held_suite(repo: Path) -> None:
    (repo / "held").mkdir()
    (repo / "held" / "test_hold.py").write_text(HOLDING)
    config = repo / "kiln.toml"
    config.write_text(config.read_text().replace("[publish]\n", HELD_SUITE + "\n[publish]\n", 1))


def _both_shards_hold(pid: int) -> set[int]:
    """The test groups once both shards run their holding test: two fork servers and the job each forked."""
    groups = {g for g in _own_groups(pid) if "kiln.tasks.testing.pytest_server" in _cmdline(g)}
    return groups if len(groups) >= 4 else set()


def test_sigterm_mid_shards_cancels_the_run_and_ends_every_shards_processes(prefect_env, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    project = git_project("tiny", tmp_path, edit=_with_held_suite)
    env = {**prefect_env, "KILN_DAEMON": "off", "KILN_TEST_HOLD": str(hold)}
    log = tmp_path / "test.log"
    args = ["test", "--config", str(project), "--out", str(tmp_path / "out"), "--suite", "held"]
    proc = _start(args, env, project.parent, log)
    started, took = _interrupt(proc, signal.SIGTERM, log, _both_shards_hold, "both shards' holding tests")
    _assert_cancelled(proc, signal.SIGTERM, log, started, took)
    text = log.read_text(errors="replace")
    assert "test/held/cpu/shard-1-of-2" in text and "test/held/cpu/shard-2-of-2" in text
