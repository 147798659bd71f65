"""The tree a run builds: its git commit, commit time, and whether it is clean.

A nightly's version is derived from the commit (so rebuilding a commit gives
the same version), and publishing refuses a tree whose tracked files differ
from its commit (untracked files such as a virtual environment do not
count). Outside a git checkout the run says so and cannot be published.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

from kiln.core.errors import ToolchainMissingError
from kiln.core.record import Checkout

log = logging.getLogger(__name__)

GIT_TIMEOUT_S = 60.0
Runner = Callable[..., subprocess.CompletedProcess[str]]


def _git(root: Path, args: list[str], runner: Runner) -> subprocess.CompletedProcess[str]:
    cmd = ["git", "-C", str(root), *args]
    log.info("running %s", " ".join(cmd))
    try:
        return runner(cmd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise ToolchainMissingError("git is not installed; Kiln derives nightly versions from the commit") from exc


def describe(root: Path, runner: Runner = subprocess.run) -> Checkout:
    """The commit checked out at ``root`` and the tracked files under ``root`` that differ from it."""
    head = _git(root, ["rev-parse", "HEAD"], runner)
    if head.returncode != 0:
        log.warning("%s is not in a git checkout (%s); its runs cannot be published", root,
                    head.stderr.strip() or head.returncode)
        return Checkout()
    commit = head.stdout.strip()
    when = _git(root, ["log", "-1", "--format=%ct", commit], runner)
    status = _git(root, ["status", "--porcelain=v1", "--untracked-files=no", "--", "."], runner)
    if when.returncode != 0 or status.returncode != 0:
        raise ToolchainMissingError(f"git could not describe {root}: {(when.stderr or status.stderr).strip()}")
    modified = tuple(sorted(line[3:].strip() for line in status.stdout.splitlines() if line.strip()))
    return Checkout(commit=commit, commit_time=int(when.stdout.strip()), modified=modified, in_git=True)
