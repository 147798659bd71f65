"""The install hint and the summary's first lines, rendered from a run's recorded facts alone.

The facts (``run.json`` info ``install``, ``published_untested``,
``published_without_suite``, ``published_uninstallable``) are what the publish step read from what it
published (:mod:`kiln.tasks.install_hint`, :mod:`kiln.tasks.releasing`); this
module only words them, so the terminal and the Prefect UI say the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from kiln.release.install.installer import held_requirements, index_options, pip_steps, printed_pip, printed_uv


def first_lines(info: Mapping[str, Any]) -> list[str]:
    """What must be read before anything else: untested publications and a version an extra index outranks."""
    lines = [f"PUBLISHED UNTESTED on its hardware: {variant} ({why})"
             for variant, why in sorted(dict(info.get("published_untested") or {}).items())]
    without_suite = dict(info.get("published_without_suite") or {})
    lines += [f"PUBLISHED UNTESTED: {why}" for _, why in sorted(without_suite.items())]
    lines += [f"PUBLISHED, WILL NOT INSTALL: {variant}: {why}"
              for variant, why in sorted(dict(info.get("published_uninstallable") or {}).items())]
    install = info.get("install")
    check = install.get("extra_check") if isinstance(install, dict) else None
    if isinstance(install, dict) and isinstance(check, dict) and check.get("state") == "below":
        lines.append(f"VERSION BELOW AN EXTRA INDEX: {install['distribution']} {check['version']} sorts below release "
                     f"{check['newest']} on {check['index']}, which an unpinned install takes instead; "
                     f"raise [project] version above {check['newest']} in kiln.toml")
    return lines


def _facts(index_url: str, install: Mapping[str, Any]) -> dict[str, Any] | None:
    facts = (install.get("indexes") or {}).get(index_url)
    return facts if isinstance(facts, dict) else None


UV_VARIANTS = ("--preview-features", "wheel-variants")


def install_command(index_url: str, install: Mapping[str, Any]) -> str:
    """The command that installs what the run published to ``index_url``, every name the index holds from it only.

    pip for a variant's index, in the steps of :func:`kiln.release.install.installer.pip_steps` (pip merges
    every index's
    candidates, so the names the index holds go in from it alone first); for the combined index of variant
    wheels (PEP 825), uv with its ``wheel-variants`` preview and its first-index strategy, which chooses the
    variant wheel the machine supports (pip, which knows no variants, would take the default CPU wheel
    there). A nightly's requirement is pinned to the exact version it published. Each command is isolated from
    the caller's pip or uv configuration (:func:`kiln.release.install.installer.printed_pip`), which could
    otherwise add an
    index or find-links behind Kiln's.
    """
    facts = _facts(index_url, install) or {}
    requirement = str(facts.get("requirement") or install.get("distribution", ""))
    extras = install.get("extra_index_urls") or []
    if facts.get("variants"):
        return printed_uv([*UV_VARIANTS, *index_options("uv", index_url, extras), requirement])
    held = held_requirements([str(r) for r in facts.get("requires") or []], facts.get("holds") or [])
    return printed_pip(pip_steps(index_url, requirement, held, extras))


def _name(text: str) -> tuple[str, bool]:
    """A requirement's project name, and whether only an extra (``pip install NAME[extra]``) asks for it."""
    try:
        requirement = Requirement(text)
    except InvalidRequirement:  # the wheel's METADATA said it; a hand-edited run.json must not break the summary
        return text, False
    return requirement.name, requirement.marker is not None and "extra" in str(requirement.marker)


def _names(names: list[str]) -> str:
    return ", ".join(names) + (" is" if len(names) == 1 else " are")


def install_reason(index_url: str, install: Mapping[str, Any]) -> str:
    """What ``index_url`` holds, what the published wheel requires, and where each requirement comes from."""
    facts, dist = _facts(index_url, install), install.get("distribution")
    if facts is None:
        return f"(this run did not record what {index_url} holds)"
    holds = list(facts.get("holds") or [])
    head = f"this index holds {', '.join(holds) or 'nothing'}"
    if facts.get("variants"):
        head = (f"every variant's wheel of {dist} (PEP 825 variant wheels: uv's preview installs the one this machine"
                f" supports, pip the default CPU wheel); {head}")
    if not facts.get("version"):
        return f"({head}; no {dist} wheel reached it in this run)"
    pythons = [str(p) for p in facts.get("pythons") or []]
    if pythons:  # a matrix variant's index: the same command on every Python
        head += (f"; a wheel of {dist} {facts['version']} for each of {', '.join(pythons)}: pip and uv install"
                 " the one of the Python they run under")
    requires = [str(r) for r in facts.get("requires") or []]
    what = f"{dist} {facts['version']}"
    if not requires:
        return f"({head}; {what} has no dependencies (its wheel declares no Requires-Dist))"
    held = {canonicalize_name(h) for h in holds}
    names = [(name, optional) for name, optional in map(_name, requires)]
    here = [n for n, optional in names if not optional and canonicalize_name(n) in held]
    elsewhere = [n for n, optional in names if not optional and canonicalize_name(n) not in held]
    parts = [head, f"{what} requires {', '.join(requires)} (its wheel's Requires-Dist)"]
    if here:
        parts.append(f"{_names(here)} on this index")
    extras = [str(u) for u in install.get("extra_index_urls") or []]
    if elsewhere and extras:
        parts.append(f"{_names(elsewhere)} not on it and resolve from {', '.join(extras)} (--extra-index-url)")
    elif elsewhere:
        parts.append(f"{_names(elsewhere)} not on it and must already be installed, or name an index for them in "
                     "kiln.toml [publish] extra_index_urls")
    return "(" + "; ".join(parts) + ")" + _unknown(install)


def _unknown(install: Mapping[str, Any]) -> str:
    check = install.get("extra_check")
    if not isinstance(check, dict) or check.get("state") != "unknown":
        return ""
    return (f" (whether an extra index holds a release of {install.get('distribution')} above {check.get('version')}"
            f" is unknown: {'; '.join(check.get('notes') or [])})")
