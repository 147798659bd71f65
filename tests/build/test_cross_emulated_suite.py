"""An aarch64 cell's suite run by the test stage under emulation (``emulate = true``): the crossdot extension's
aarch64 wheel, cross-built here, installed by uv for an aarch64 CPython 3.11 with pytest, and its suite run by
pytest under Debian's arm64 CPython through qemu-user, as a guest: its own loopback, and Landlock holding it to the
userland (read) and its own folder (write) even when it leaves the chroot. A test that fails under emulation fails the unit; the x86_64 cell's suite runs as always.

Opt-in (KILN_TEST_AARCH64=1), as tests/build/test_cross_emulated.py: root, qemu-user-static, debootstrap, and the
first time minutes to make the userland (kept in ~/.cache/kiln/aarch64-userland).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.build import cross
from kiln.tasks.testing import emulation
from kiln.tasks.testing.emulated import parse_junit
from tests.build.test_cross_nightly import KILN_TOML
from tests.helpers.gitrepo import git_project
from tests.helpers.hostile import Listener

TESTS = '''import os, platform, socket

import crossdot


def test_dot_on_aarch64():
    assert platform.machine() == "aarch64" and crossdot._fast.__file__.endswith("aarch64-linux-gnu.so")
    assert crossdot.dot([1.5, -2.0], [4.0, 0.5]) == 5.0


def test_the_host_stays_out_of_reach_even_out_of_the_chroot():
    try:  # its own loopback: the host's listener is not on it
        socket.create_connection(("127.0.0.1", %(port)d), timeout=5).close()
        reached = True
    except OSError:
        reached = False
    assert not reached
    here = os.path.dirname(os.path.abspath(__file__))
    child = os.fork()  # the escape changes the process's root: a child of its own tries it
    if child == 0:
        try:  # root of its own user namespace may leave the chroot: Landlock still holds it to the userland
            os.mkdir(os.path.join(here, "out"))
            os.chroot(os.path.join(here, "out"))
            for _ in range(64):
                os.chdir("..")
            os.chroot(".")
        except OSError:
            pass
        try:
            with open(%(canary)r) as handle:
                handle.read()
            os._exit(1)
        except OSError:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0  # the host's file was not read


def test_that_fails_under_emulation():
    assert crossdot.dot([1.0], [1.0]) == 3.0


def test_the_suite_s_pass_env_reaches_it():
    assert os.environ.get("KILN_EMU_PROBE") == "seen"


def test_that_hangs_past_its_test_timeout():
    import time
    time.sleep(600)
'''


def _emulated(project: Path, port: int, canary: Path) -> None:
    text = KILN_TOML.replace('publish_untested = true  # its aarch64 cell\'s suite cannot run on this x86_64 machine',
                             "emulate = true\nrequired = false\npass_env = [\"KILN_EMU_PROBE\"]\n"
                             "test_timeout_s = 30")
    assert "emulate = true" in text, "the cross nightly's kiln.toml changed"
    (project / "kiln.toml").write_text(text)
    (project / "tests").mkdir()
    (project / "tests" / "test_dot.py").write_text(TESTS % {"port": port, "canary": str(canary)})


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get(emulation.OPT_IN) != "1",
                    reason="emulated aarch64 suite: set KILN_TEST_AARCH64=1 (root, network, minutes the first time)")
def test_an_aarch64_cells_suite_runs_under_emulation_when_it_asks(prefect_server, tmp_path, monkeypatch):
    from kiln.flows.test import test_flow

    if why := emulation.cannot_emulate() or ("" if cross.compiler(cross.target("aarch64")) else "no cross gcc"):
        pytest.skip(why)
    monkeypatch.setenv("KILN_EMU_PROBE", "seen")  # named by the suite's pass_env: it reaches the emulated tests
    canary = tmp_path / "credentials"  # a file of the host's, outside the userland
    canary.write_text("[default]\naws_secret_access_key = canary\n")
    listener = Listener()  # on the host's loopback: the suite has a loopback of its own
    try:
        config = git_project("crossdot", tmp_path, edit=lambda project: _emulated(project, listener.port, canary))
        out = tmp_path / "out"
        state = test_flow(config_path=str(config), out=str(out), return_state=True)
    finally:
        listener.close()
    assert listener.accepted == 0
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    arm, x86 = units["test/unit/cpupy311aarch64"], units["test/unit/cpupy311"]
    assert arm.state == "failed" and arm.message.startswith("3 passed, 1 failed, 1 timeout"), arm.message
    assert "under emulation: aarch64 CPython 3.11" in arm.message, arm.message
    assert x86.state == "failed" and x86.message.startswith("2 passed, 2 failed, 1 timeout"), x86.message  # x86_64
    [report] = [run.root / a.path for a in run.artifacts_of("report") if a.variant == "cpupy311aarch64"]
    outcomes = {r.nodeid.rsplit("::", 1)[1]: r.outcome for r in parse_junit(report)}
    assert outcomes == {"test_dot_on_aarch64": "passed", "test_the_host_stays_out_of_reach_even_out_of_the_chroot":
                        "passed", "test_that_fails_under_emulation": "failed",
                        "test_the_suite_s_pass_env_reaches_it": "passed",
                        "test_that_hangs_past_its_test_timeout": "timeout"}  # ended by its test_timeout_s
    assert not (emulation.BINFMT / emulation.ENTRY).exists()  # the registration was undone
