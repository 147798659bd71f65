"""Running a cross-built wheel under emulation: an aarch64 Debian userland run by qemu-user on this x86_64 host.

The userland is Debian's own packages (``debootstrap --arch=arm64 --foreign --variant=minbase --include=python3``,
then its second stage inside the chroot), made once and kept in a cache folder: minutes to make, seconds to
reuse. It is made under a temporary name and renamed into place whole, so an interrupted run leaves nothing
a later run would take for a userland.

Its aarch64 programs run through the kernel's binfmt_misc: ``qemu-aarch64-static`` registered for aarch64 ELF
files with the ``F`` flag (the kernel opens the emulator when it is registered, so it works inside the chroot,
where no such file exists). The registration is Kiln's own entry, made for the span of a ``with`` and removed
after, binfmt_misc unmounted again if Kiln mounted it; an entry someone else made for aarch64 is left alone and
used. All of this needs root.

What a run here proves: the wheel installs on an aarch64 Debian with its own CPython, its extension loads
(the right ELF machine, extension suffix, glibc symbol versions) and computes what the reference computes,
instruction by instruction as an aarch64 CPU defines them. What it cannot: speed, and anything on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kiln.core.errors import PermanentError
from kiln.tasks.process import run_in_group

_log = logging.getLogger(__name__)

BINFMT = Path("/proc/sys/fs/binfmt_misc")
ENTRY = "kiln-qemu-aarch64"
QEMU = "/usr/bin/qemu-aarch64-static"  # Debian's qemu-user-static
# The process that registered ENTRY: in /run (a tmpfs, cleared at boot as binfmt_misc's entries are)
OWNER = Path("/run") / f"{ENTRY}.owner"
# aarch64 ELF executables and shared objects, as Debian's qemu-user-static registers them (its binfmt.d file)
_MAGIC = r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
_MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
SUITE = "bookworm"
USERLAND_PYTHON = "3.11"  # bookworm's CPython: the one an emulated suite runs
MIRROR = "http://deb.debian.org/debian"
DEBOOTSTRAP_TIMEOUT_S = 1800


class EmulationError(PermanentError):
    """The aarch64 userland could not be made or run (no root, no qemu-user-static, no debootstrap)."""


OPT_IN = "KILN_TEST_AARCH64"  # =1: the opt-in emulated check of an aarch64 wheel (tests/build/test_cross_emulated.py)


def no_runner_reason(platforms: Sequence[str], machine: str | None = None, emulate: bool = False,
                     python: str = USERLAND_PYTHON) -> str:
    """Why a suite of a wheel for ``platforms`` (a variant's CPUs) does not run on this ``machine``, or "".

    A suite runs Kiln's test runner (pytest, its fork server, the wheel's dependencies from the indexes) in an
    environment of the cell's Python on the machine's own CPU; under emulation that is a whole aarch64 Python
    stack per suite, which Kiln does not make. So an aarch64 cell's suites are "not run" on an x86_64 machine
    (invariant 9), and say what proves its wheel here instead: the opt-in emulated check, which installs the
    wheel into an emulated aarch64 Debian and runs its extension against the reference. A suite that asks for
    emulation (``emulate``) runs under it instead where this machine can (x86_64, root, qemu-user-static,
    debootstrap) and the cell's ``python`` is the userland's, else says why not."""
    machine = machine or platform.machine()
    if machine in platforms:
        return ""
    cpus = "/".join(platforms)
    if emulate and machine == "x86_64" and tuple(platforms) == ("aarch64",):
        why = cannot_emulate()  # else the suite runs under emulation (kiln.tasks.testing.emulated)
        if python != USERLAND_PYTHON:
            why = f"the emulated userland's CPython is {USERLAND_PYTHON} ({SUITE}); this cell is for Python {python}"
        return f"not run: the suite asks to run under emulation (emulate = true), but {why}" if why else ""
    return (f"not run: no {cpus} runner (this machine is {machine}); the wheel is compiled and tagged here,"
            f" and run only by the opt-in emulated check ({OPT_IN}=1, as root with qemu-user-static and"
            " debootstrap), or by the suite on a worker of that CPU")


def cannot_emulate() -> str:
    """Why this machine cannot run aarch64 code under emulation (what it lacks), or ""."""
    missing = missing_tools()
    return f"this machine cannot emulate aarch64: no {', '.join(missing)}" if missing else ""


def missing_tools() -> list[str]:
    """What this host lacks to emulate aarch64 (empty: nothing)."""
    missing = [] if os.geteuid() == 0 else ["root (binfmt_misc and chroot)"]
    missing += [f"{tool} (Debian's {package})" for tool, package in
                ((QEMU, "qemu-user-static"), ("debootstrap", "debootstrap")) if shutil.which(tool) is None]
    return missing


def _run(cmd: list[str], timeout_s: float, what: str) -> str:
    ladder, out = run_in_group(cmd, timeout_s)
    if ladder.timed_out or ladder.returncode != 0:
        raise EmulationError(f"{what} failed (exit {ladder.returncode}, {ladder.escalation or 'in time'}):\n"
                             f"{out[-3000:]}")
    return out


@contextlib.contextmanager
def aarch64_binfmt(timeout_s: float = 30, owner: Path = OWNER) -> Iterator[None]:
    """qemu-aarch64-static registered for aarch64 ELF files (flag F) for the span of the ``with``; undone after.

    The registration outlives a run killed by SIGKILL (its ``finally`` never runs), so the run that registers
    writes its process to ``owner`` (in ``/run``: gone at boot, as the registration is). An entry whose owner
    process is gone is a killed run's: the next run takes it over and undoes it. An entry with no owner record
    is someone else's and is left as it is."""
    mounted = False
    if not (BINFMT / "register").exists():
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], timeout_s, "mounting binfmt_misc")
        mounted = True
    ours = not (BINFMT / ENTRY).exists() or _stale(owner)
    try:
        if ours:
            owner.write_text(_process_id(os.getpid()))
            if not (BINFMT / ENTRY).exists():
                (BINFMT / "register").write_text(f":{ENTRY}:M::{_MAGIC}:{_MASK}:{QEMU}:F")
        yield
    finally:
        if ours and (BINFMT / ENTRY).exists():
            (BINFMT / ENTRY).write_text("-1")
        if ours:
            owner.unlink(missing_ok=True)
        if mounted:
            _run(["umount", str(BINFMT)], timeout_s, "unmounting binfmt_misc")


def _process_id(pid: int) -> str:
    """``pid`` and its start time (a reused pid is another process): ``"1234 567890"``, or the pid alone."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return str(pid)
    return f"{pid} {started}"


def _stale(owner: Path) -> bool:
    """Whether ``owner`` names a registering process that is gone (a run killed before it undid its entry)."""
    try:
        recorded = owner.read_text().strip()
    except FileNotFoundError:
        return False
    pid = int(recorded.split()[0]) if recorded.split() and recorded.split()[0].isdigit() else 0
    return pid <= 0 or not _alive(pid) or _process_id(pid) != recorded


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _removed(root: Path, timeout_s: float = 60) -> None:
    """``root`` deleted, after unmounting what is mounted below it: debootstrap's second stage mounts /proc and
    /sys in the chroot, and a run killed mid-stage leaves them there (deleting through them would reach the
    host's)."""
    inside = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in inside if Path(m).is_relative_to(root)), key=len, reverse=True):
        _run(["umount", point], timeout_s, f"unmounting {point}")
    shutil.rmtree(root, ignore_errors=True)


def userland(cache_dir: Path, timeout_s: float = DEBOOTSTRAP_TIMEOUT_S) -> Path:
    """Debian's arm64 userland with python3, made once under ``cache_dir`` (call inside :func:`aarch64_binfmt`)."""
    final = cache_dir / f"{SUITE}-arm64-python3"
    if (final / "usr" / "bin" / "python3").exists():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(f".{final.name}.partial-*"):  # a killed run's; a live one's is left to it
        if not _alive(int(stale.name.rsplit("-", 1)[1])):
            _removed(stale)
    partial = cache_dir / f".{final.name}.partial-{os.getpid()}"
    _removed(partial)
    try:
        _run(["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase", "--include=python3", SUITE,
              str(partial), MIRROR], timeout_s, "debootstrap's first stage")
        # dpkg's fsync after every file, each an emulated syscall on a shared disk, was most of the second stage;
        # the userland is a cache (made again whole if a run dies), so its writes need not be durable
        (partial / "etc" / "dpkg" / "dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
        (partial / "etc" / "dpkg" / "dpkg.cfg.d" / "kiln-unsafe-io").write_text("force-unsafe-io\n")
        _run(["chroot", str(partial), "/debootstrap/debootstrap", "--second-stage"], timeout_s,
             "debootstrap's second stage (under qemu)")
        os.replace(partial, final)
    finally:
        _removed(partial)
    return final


def installed(root: Path, wheel: Path, name: str) -> str:
    """``wheel`` unpacked as a site folder inside the userland at ``root`` (a wheel's install is its files in
    site-packages; the minimal userland has no pip); the folder's path as seen inside it."""
    inside = f"/opt/kiln/{name}"
    target = root / inside.lstrip("/")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return inside


def run_python(root: Path, code: str, path: Sequence[str] = (), timeout_s: float = 300) -> str:
    """``python3 -c code`` in the userland (with ``path`` first on sys.path); its output."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(path), "LC_ALL": "C.UTF-8"}
    cmd = ["chroot", str(root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
           "/usr/bin/python3", "-s", "-c", code]
    return _run(cmd, timeout_s, "the emulated aarch64 Python")

