"""``kiln init``: inspect a package's repository and write the ``kiln.toml`` that makes ``kiln nightly`` work.

:func:`init_project` is the one entry point: it refuses an existing
``kiln.toml`` before reading anything else, checks the text it rendered with
Kiln's own config loader, and only then writes the file (never over another).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import ConfigError
from kiln.tasks.onboarding.inspect import Findings, OnboardingError, inspect_project
from kiln.tasks.onboarding.pythons import with_python_axis
from kiln.tasks.onboarding.render import render
from kiln.tasks.onboarding.stable import with_stable_abi

__all__ = ["InitResult", "OnboardingError", "init_project", "inspect_project", "render"]
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitResult:
    path: Path
    findings: Findings
    text: str


def _check(text: str, root: Path) -> None:
    import tomllib

    from kiln.tasks.project.config import parse_config

    try:
        parse_config(tomllib.loads(text), root, "the kiln.toml kiln init wrote")
    except (ConfigError, tomllib.TOMLDecodeError) as exc:  # a bug of kiln init's, never the user's: say so
        raise OnboardingError(f"kiln init inferred a kiln.toml that Kiln's loader refuses ({exc}); nothing was"
                              " written: write kiln.toml by hand from the README and report this") from exc


def init_project(directory: str | Path = ".") -> InitResult:
    """Write ``<directory>/kiln.toml`` for the package there; raise :class:`OnboardingError`, writing nothing."""
    root = Path(directory).resolve()
    target = root / "kiln.toml"
    if target.exists():
        raise OnboardingError(f"{target} already exists; kiln init never overwrites it (move it away to start"
                              " again, or edit it)")
    findings = inspect_project(root)
    text = with_python_axis(render(findings), findings.kind, findings.torch_extension, findings.requires_python, root)
    text = with_stable_abi(text, root) if findings.torch_extension else text
    _check(text, root)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # never over a file made meanwhile
    except FileExistsError:
        raise OnboardingError(f"{target} appeared while kiln init ran; it was left as it is") from None
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    _log.info("wrote %s (%s package %s)", target, findings.kind, findings.distribution)
    return InitResult(target, findings, text)
