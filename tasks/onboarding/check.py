"""``kiln init --check``: where a repository's ``kiln.toml`` disagrees with what its build reads (pure: reads files).

It infers the ``kiln.toml`` that ``kiln init`` would write today and compares what the build itself decides —
the import package, the distribution, which variants can be built, and each variant's build switches — with
the file the team keeps. Everything else (archs, suites, publish targets) is the team's choice, never a
disagreement. Each line names the key to change and why, in the words ``kiln init`` gives for it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from kiln.core.errors import ConfigError
from kiln.tasks.onboarding.inspect import Findings, OnboardingError, inspect_project
from kiln.tasks.onboarding.render import render
from kiln.tasks.project.config import KilnConfig, load_config, parse_config


def _why(findings: Findings, name: str) -> str:
    reason = next((r for r in findings.reasons if r.startswith(f"build_env {name}=")), "")
    return f" ({reason.split(': ', 1)[1]})" if ": " in reason else ""


def _variants(inferred: KilnConfig, kept: KilnConfig, findings: Findings) -> list[str]:
    lines: list[str] = []
    by_backend = {v.backend: v for v in kept.variants}
    for want in inferred.variants:
        have = by_backend.get(want.backend)
        if have is None:
            lines.append(f"no [[variants]] with backend = {want.backend!r}: its build can make one"
                         f" (kiln init would write {want.name!r})")
            continue
        for name, value in sorted(want.build_env.items()):
            if have.build_env.get(name) != value:
                now = f"it is {have.build_env[name]!r}" if name in have.build_env else "it is not set"
                lines.append(f"[[variants]] {have.name} build_env: {name} = {value!r} is what its build needs, {now}"
                             f"{_why(findings, name)}")
    backends = {v.backend for v in inferred.variants}
    lines += [f"[[variants]] {v.name}: its build has no {v.backend} path kiln init can see (no {v.backend} variant"
              " inferred); check it builds what its name says" for v in kept.variants if v.backend not in backends]
    return lines


def check_project(directory: str | Path = ".") -> list[str]:
    """One line per disagreement between ``<directory>/kiln.toml`` and what the build reads; empty: they agree.
    Raise :class:`OnboardingError` where there is no kiln.toml to check or it does not load."""
    root = Path(directory).resolve()
    target = root / "kiln.toml"
    if not target.is_file():
        raise OnboardingError(f"{target} does not exist: kiln init --check compares a kiln.toml with the build;"
                              " run kiln init to write one")
    try:
        kept = load_config(target)
    except ConfigError as exc:
        raise OnboardingError(f"{target} does not load ({exc}); fix it, then run kiln init --check again") from exc
    findings = inspect_project(root)
    inferred = parse_config(tomllib.loads(render(findings)), root, "the kiln.toml kiln init would write")
    lines = [f"[project] {key} = {getattr(kept.project, key)!r}, but its build config says {want!r}"
             for key, want in (("package", findings.package), ("distribution", findings.distribution),
                               ("source", findings.source)) if getattr(kept.project, key) != want]
    lines += _variants(inferred, kept, findings)
    if findings.missing_sources:
        lines.append(f"its build names native sources the tree does not hold: {', '.join(findings.missing_sources)}")
    return lines
