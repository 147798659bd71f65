"""An aarch64 cell's suite run under emulation on this x86_64 machine, when the suite asks (``emulate = true``).

Slow and opt-in per suite: the suite's tests run by pytest under Debian's arm64 CPython in the emulated userland
(:mod:`kiln.tasks.testing.emulation`: qemu-user through binfmt_misc, root). What it holds:

- the cell's wheel, what it requires and the suite's ``requires``, with pytest, installed by uv for the target
  (``--target`` a folder of the userland, ``--python-platform aarch64-manylinux_2_28``, the cell's Python;
  wheels only: uv evaluates the wheels' markers for aarch64, and nothing it installs runs here);
- a copy of the suite's paths, run from that copy.

pytest runs as a guest (:func:`kiln.core.sandbox.guest_command`): the chroot is entered inside the guest's own
user and network namespaces (its loopback only), Landlock lets it read the userland and write only the suite's
folder in it, and its environment is ``env -i`` with the userland's paths. Emulated suites run one at a time on
a machine (a lock beside the userland): the binfmt_misc entry is the machine's, made and removed around each.
Its results come from pytest's JUnit XML, opened without following a link, as a regular file of bounded size,
and written again by Kiln as the suite's report; a suite whose pytest wrote none (or an unreadable one) fails,
naming pytest's output. The userland is Debian bookworm's, whose CPython is 3.11: a cell of another Python is
"not run" (:func:`kiln.tasks.testing.emulation.no_runner_reason`).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import cast, get_args

from kiln.core.errors import InfrastructureError
from kiln.core.fsutil import polled_lock
from kiln.core.sandbox import guest_command, guest_environ, installer_command
from kiln.core.venvs import uv_command
from kiln.tasks.build.buildenv import uv_source_options
from kiln.tasks.build.cross import default_cache_dir
from kiln.tasks.process import run_tool
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.project.config_matrix import cell_python
from kiln.tasks.testing import emulation
from kiln.tasks.testing.classify import Outcome, TestResult
from kiln.tasks.testing.envs import installer_env
from kiln.tasks.testing.reports import write_junit
from kiln.tasks.testing.suite import SuiteRun, SuiteTarget, suite_outcome

_log = logging.getLogger(__name__)
INSTALL_TIMEOUT_S = 900.0
PLATFORM = "aarch64-manylinux_2_28"  # uv's --python-platform for an aarch64 cell
MAX_REPORT_BYTES = 16 << 20


def userland_cache() -> Path:
    """Where the emulated userland is kept between runs (beside the cross build's cache)."""
    return default_cache_dir().parent / "aarch64-userland"


def emulates(target: SuiteTarget, machine: str) -> bool:
    """Whether ``target`` runs under emulation here: its suite asks, its cell is aarch64, this is x86_64."""
    return target.suite.emulate and machine == "x86_64" and target.variant.platform == ("aarch64",)


def run_emulated_suite(config: KilnConfig, target: SuiteTarget, wheel: Path, view: str | Path,
                       indexes: Sequence[str] = ()) -> SuiteRun:
    """Run ``target``'s suite on ``wheel`` under emulation (see the module docs); its results and report."""
    start = time.monotonic()
    junit = Path(view).resolve() / "tests" / f"{target.name}.junit.xml"
    junit.unlink(missing_ok=True)  # a report is this run's or none
    cache = userland_cache()
    with polled_lock(cache.parent / "aarch64-emulation.lock", start + target.suite.deadline_s,
                     f"the emulated suite {target.name}, waiting for another emulated suite",
                     InfrastructureError), emulation.aarch64_binfmt():
        root = emulation.userland(cache)
        slot = _prepared(config, target, wheel, root, indexes)
        try:
            done = _pytest(root, slot, target)
            data, problem = _report(slot / "report.xml")
        finally:
            shutil.rmtree(slot, ignore_errors=True)
    elapsed = time.monotonic() - start
    results = parse_junit_bytes(data) if data is not None else []
    if not results:
        why = problem or f"pytest (exit {done.returncode}) reported no test; its output ends:\n" \
                         f"{done.stdout[-2000:].strip()}"
        return SuiteRun(target.name, (), target.unit("failed", f"the emulated aarch64 suite: {why}", elapsed), (),
                        elapsed)
    write_junit(junit, target.name, results)
    state, message = suite_outcome(results)
    python = cell_python(target.variant)
    unit = target.unit(state, f"{message} (under emulation: aarch64 CPython {python}, qemu-user)", elapsed)
    _log.info("suite %s: %s", target.name, unit.message)
    return SuiteRun(target.name, tuple(results), unit, (junit,), elapsed)


def _prepared(config: KilnConfig, target: SuiteTarget, wheel: Path, root: Path, indexes: Sequence[str]) -> Path:
    """The suite's folder in the userland: the wheel and what it needs installed, its paths copied."""
    slot = root / "opt" / "kiln" / "suites" / target.name
    shutil.rmtree(slot, ignore_errors=True)
    for folder in ("home", "site"):  # made here: the guests may write only folders that exist
        (slot / folder).mkdir(parents=True)
    _install(slot / "site", wheel, [*target.suite.requires, "pytest", "pytest-timeout"], indexes,
             cell_python(target.variant))
    _copy_paths(config, target.suite.paths, slot / "project")
    return slot


def _pytest(root: Path, slot: Path, target: SuiteTarget) -> subprocess.CompletedProcess[str]:
    """pytest on the suite's copied paths in the userland, as a guest, under the suite's deadline, each test under
    its ``test_timeout_s`` (pytest-timeout), with the variables its ``pass_env`` names (never a credential's)."""
    suite, inside = target.suite, "/" + slot.relative_to(root).as_posix()
    environ = guest_environ(slot / "home", pass_env=suite.pass_env)
    # every variable but the passed ones unset by name: their values travel in the environment, which only this
    # user may read, never on the command line, which every local user may
    unset = [option for name in sorted(environ) if name not in suite.pass_env for option in ("-u", name)]
    cmd = ["/usr/sbin/chroot", str(root), "/usr/bin/env", *unset, "-C", f"{inside}/project",
           "PATH=/usr/bin:/bin", f"PYTHONPATH={inside}/site", "LC_ALL=C.UTF-8", f"HOME={inside}/home",
           "/usr/bin/python3", "-s", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--timeout={suite.test_timeout_s:g}", f"--junitxml={inside}/report.xml",
           *(("-m", suite.markers) if suite.markers else ()), *suite.paths]
    guest = guest_command(cmd, read=[root], write=[slot, root / "dev" / "null"], network="loopback")
    return run_tool(guest, suite.deadline_s, env=environ)


def _report(path: Path) -> tuple[bytes | None, str]:
    """The guest's report: a regular file, not a link, at most :data:`MAX_REPORT_BYTES`; else None and why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"its report {path.name} could not be opened as a file ({exc.strerror}): not read"
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_REPORT_BYTES:
            return None, f"its report {path.name} is not a regular file of at most {MAX_REPORT_BYTES} bytes: not read"
        return handle.read(MAX_REPORT_BYTES), ""


def _install(site: Path, wheel: Path, requirements: Sequence[str], indexes: Sequence[str], python: str) -> None:
    # uv reads no pip.conf: the machine's sources, as a cell's build environment gets them, and the run's indexes
    options = [*uv_source_options(), *(option for url in indexes for option in ("--extra-index-url", url))]
    cmd = [*uv_command(), "pip", "install", "--quiet", "--target", str(site), "--python-platform", PLATFORM,
           "--python-version", python, *options, str(wheel), *requirements]
    guest, env = installer_command(cmd, sys.executable, installer_env(), read=[wheel.parent], write=[site])
    done = run_tool(guest, INSTALL_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise InfrastructureError(f"uv could not install {wheel.name} and {list(requirements)} for an aarch64"
                                  f" CPython {python}:\n{done.stdout[-3000:].strip()}")


def _copy_paths(config: KilnConfig, paths: Sequence[str], dest: Path) -> list[str]:
    """The suite's paths copied below ``dest`` as they lie below the project; their relative names."""
    names = []
    for name in paths:
        source, target = config.path(name), dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        # links copied as links, never followed here (outside the sandbox): inside the chroot they name the userland
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, target, follow_symlinks=False)
        names.append(name)
    return names


_OUTCOMES: dict[str, Outcome] = {"failure": "failed", "error": "error", "skipped": "skipped"}


def parse_junit(path: Path) -> list[TestResult]:
    """The tests of a pytest JUnit XML report at ``path`` (:func:`parse_junit_bytes`)."""
    return parse_junit_bytes(path.read_bytes())


# pytest-timeout's message for a test past its test_timeout_s ("Failed: Timeout (>30.0s) from pytest-timeout.")
_TIMED_OUT = "Failed: Timeout (>"


def parse_junit_bytes(data: bytes) -> list[TestResult]:
    """The tests of a pytest JUnit XML report, each with its outcome, duration and first line of message; none
    when the report cannot be read (a truncated or forged file is no result)."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError:
        return []
    results = []
    for case in root.iter("testcase"):
        outcome: Outcome = "passed"
        message = ""
        for child in case:
            if child.tag in _OUTCOMES:
                text = child.get("message") or ""
                outcome, message = _OUTCOMES[child.tag], (text.splitlines() or [""])[0]
                if outcome == "failed" and message.startswith(_TIMED_OUT):  # as the native runner counts it
                    outcome = "timeout"
                break
        recorded = case.find("properties/property[@name='kiln.outcome']")  # Kiln's own report says it exactly
        if recorded is not None and recorded.get("value") in get_args(Outcome):
            outcome = cast(Outcome, recorded.get("value"))
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        try:
            duration = float(case.get("time") or 0.0)
        except ValueError:
            duration = 0.0
        results.append(TestResult(nodeid=nodeid, outcome=outcome, duration_s=duration, message=message[:300]))
    return results


__all__ = ["emulates", "parse_junit", "parse_junit_bytes", "run_emulated_suite", "userland_cache"]
