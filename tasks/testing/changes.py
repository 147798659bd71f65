"""``--changed-since REF``: run only the suites whose declared sources changed.

A suite depends on the paths in its ``depends`` and on its own test paths. A
change to the pipeline's description (``kiln.toml``) or to a file of
``[testing] select_all`` (build files, a top-level ``conftest.py``...) can
change every test, so it selects every suite. Paths come from ``git diff --name-only --relative REF`` run in
the config's directory, so they are relative to it like the config's own.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from kiln.core.errors import InvalidInputError, ToolchainMissingError
from kiln.tasks.project.config import KilnConfig, Suite

logger = logging.getLogger(__name__)

GIT_TIMEOUT_S = 60.0

Runner = Callable[..., subprocess.CompletedProcess[str]]


def changed_files(ref: str, root: Path, runner: Runner = subprocess.run, timeout: float = GIT_TIMEOUT_S) -> list[str]:
    """Files changed between ``ref`` and the working tree, relative to ``root``."""
    if not ref or ref.startswith("-") or any(ch.isspace() or ord(ch) < 32 for ch in ref):
        raise InvalidInputError(f"--changed-since {ref!r} is not a git revision")
    cmd = ["git", "diff", "--name-only", "--relative", ref, "--"]
    logger.info("running %s in %s", " ".join(cmd), root)
    try:
        proc = runner(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise ToolchainMissingError("git is not installed; --changed-since needs it") from exc
    except subprocess.TimeoutExpired as exc:
        raise InvalidInputError(f"git diff against {ref!r} did not finish in {timeout:g}s") from exc
    if proc.returncode != 0:
        raise InvalidInputError(f"--changed-since {ref!r}: git diff failed: {proc.stderr.strip() or proc.returncode}")
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def _under(path: str, prefix: str) -> bool:
    pure, base = PurePosixPath(path), PurePosixPath(prefix.rstrip("/"))
    return pure == base or base in pure.parents


def suite_changed(suite: Suite, changed: Sequence[str]) -> list[str]:
    """The changed files that select ``suite`` (empty: it can be skipped)."""
    watched = (*suite.depends, *suite.paths)
    return [path for path in changed if any(_under(path, prefix) for prefix in watched)]


def select_suites(
    config: KilnConfig, changed: Sequence[str], config_name: str = "kiln.toml"
) -> tuple[list[Suite], dict[str, str]]:
    """(suites to run, why each was selected or left out)."""
    global_hits = [p for p in changed if p == config_name or any(_under(p, f) for f in config.testing.select_all)]
    reasons: dict[str, str] = {}
    selected = []
    for suite in config.suites:
        hits = global_hits or suite_changed(suite, changed)
        if hits:
            selected.append(suite)
            reasons[suite.name] = f"selected: {', '.join(hits[:3])}{' …' if len(hits) > 3 else ''} changed"
        else:
            reasons[suite.name] = "left out: none of its dependencies changed"
    return selected, reasons


def suites_to_run(config: KilnConfig, names: Sequence[str] | None, changed_since: str | None,
                  config_name: str = "kiln.toml", runner: Runner = subprocess.run) -> list[Suite]:
    """The suites a test run covers: by name (all when None), then by changed files."""
    known = {s.name: s for s in config.suites}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise InvalidInputError(f"unknown suite(s) {unknown}; kiln.toml defines {sorted(known)}")
    chosen = [known[n] for n in names] if names else list(config.suites)
    if changed_since is None:
        return chosen
    changed = changed_files(changed_since, config.root, runner)
    selected, reasons = select_suites(config, changed, config_name)
    for name, reason in reasons.items():
        logger.info("suite %s: %s", name, reason)
    return [s for s in chosen if s in selected]
