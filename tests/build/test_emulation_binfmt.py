"""The qemu registration an emulated run makes is undone even when that run is killed by SIGKILL: the next run
takes over an entry whose registering process is gone, and leaves alone one nobody recorded. Needs root and
Debian's qemu-user-static (skipped otherwise); registers for a moment, runs nothing under emulation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.core.errors import InfrastructureError
from kiln.core.fsutil import polled_lock
from kiln.tasks.testing import emulation
from kiln.tasks.testing.emulated import userland_cache

pytestmark = pytest.mark.skipif(bool(emulation.cannot_emulate()), reason=emulation.cannot_emulate() or "can emulate")

_KILLED = """
import os, signal, sys
from pathlib import Path
from kiln.tasks.testing import emulation
with emulation.aarch64_binfmt(owner=Path(sys.argv[1])):
    print("registered", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def emulation_lock():
    """The lock every emulated suite holds around its registration: no other Kiln run registers meanwhile."""
    with polled_lock(userland_cache().parent / "aarch64-emulation.lock", time.monotonic() + 600,
                     "the binfmt test", InfrastructureError):
        yield


def test_a_registration_a_killed_run_left_is_undone_by_the_next_run(tmp_path, emulation_lock):
    entry, owner = emulation.BINFMT / emulation.ENTRY, tmp_path / "owner"
    assert not entry.exists(), "a registration is already there: another emulated run is going on"
    done = subprocess.run([sys.executable, "-c", _KILLED, str(owner)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL and "registered" in done.stdout
    assert entry.exists() and owner.is_file()  # what SIGKILL leaves behind
    with emulation.aarch64_binfmt(owner=owner):
        assert entry.exists()
        assert owner.read_text().split()[0] == str(os.getpid())  # taken over
    assert not entry.exists() and not owner.exists()


def test_a_registration_nobody_recorded_is_left_as_it_is(tmp_path, emulation_lock):
    entry, owner = emulation.BINFMT / emulation.ENTRY, tmp_path / "owner"
    assert not entry.exists(), "a registration is already there: another emulated run is going on"
    (emulation.BINFMT / "register").write_text(f":{emulation.ENTRY}:M::{emulation._MAGIC}:{emulation._MASK}:"
                                              f"{emulation.QEMU}:F")
    try:
        with emulation.aarch64_binfmt(owner=owner):
            assert not owner.exists()
        assert entry.exists()  # not Kiln's run's to undo
    finally:
        if entry.exists():
            entry.write_text("-1")
