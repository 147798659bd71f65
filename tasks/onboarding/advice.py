"""What to set when a package's build unit fails: its log matched against the switches its build reads (pure).

A first nightly that fails because a switch is missing should end in the setting to change, not in a log
tail: ``setup.py raised 'X_CUDA_MAJOR env var must be set': add X_CUDA_MAJOR = "13" to [[variants]] cu130
build_env``. :func:`what_to_set` reads the repository as ``kiln init`` does (nothing runs) and compares each
switch the build reads with the failed variant's ``build_env``; the unit's failure message appends its lines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from kiln.tasks.onboarding.inspect import Findings, OnboardingError, inspect_project

_NO_LIBRARY = "holds no shared library"
_KEY_ERROR = re.compile(r"KeyError: ['\"]([A-Za-z_][A-Za-z0-9_]*)['\"]")


def _why(findings: Findings, name: str) -> str:
    reason = next((r for r in findings.reasons if r.startswith(f"build_env {name}=")), "")
    return reason.split(": ", 1)[1] if ": " in reason else "its build reads it"


def _said(log: str, name: str) -> str:
    """The last line of ``log`` that names ``name`` (what the build printed about it), or ''."""
    return next((line.strip() for line in reversed(log.splitlines()) if name in line), "")


def advise(findings: Findings, variant: str, backend: str, build_env: Mapping[str, str], log: str) -> list[str]:
    """The settings to change for ``variant`` (its ``backend`` and ``build_env``) given what its build printed."""
    wanted = dict(findings.gpu_env if backend != "cpu" else findings.cpu_env)
    lines: list[str] = []
    for name, value in wanted.items():
        if build_env.get(name) == value:
            continue
        add = f'add {name} = "{value}" to [[variants]] {variant} build_env'
        said = _said(log, name)
        if said:
            lines.append(f"its build printed {said[:200]!r}: {add}")
        elif _NO_LIBRARY in log:
            lines.append(f"the wheel {_NO_LIBRARY} and {_why(findings, name)}: {add}")
        else:
            lines.append(f"{_why(findings, name)}: {add}")
    read = {entry.split(" ", 1)[0] for entry in findings.also_read}
    for name in dict.fromkeys(_KEY_ERROR.findall(log)):
        if name not in wanted and name not in build_env and name in read:
            lines.append(f"setup.py raised KeyError {name!r}: it requires {name}; set it in [[variants]] {variant}"
                         " build_env")
    return lines


def what_to_set(root: Path, variant: str, backend: str, build_env: Mapping[str, str], log: str) -> list[str]:
    """:func:`advise` for the repository at ``root`` (its build files read, never run); [] where the repository
    cannot be read as kiln init reads it (the failure message then stands as it is)."""
    try:
        findings = inspect_project(root)
    except OnboardingError:
        return []
    return advise(findings, variant, backend, build_env, log)
