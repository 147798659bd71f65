"""The end-of-run summary: a terminal table and the run's markdown artifact.

Both are rendered from ``run.json`` alone, so what the terminal, the Prefect
UI and the manifest say about a run can never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

from packaging.requirements import InvalidRequirement, Requirement

from kiln.release.install import index_options
from kiln.release.manifest import MANIFEST_NAME, RunManifest, Stage, Unit, UnitState

TEST_TABLE_INFO = "test_table:"  # run info key prefix (+ unit id) of a suite's problem-test table
# What a release engineer must read first; every UnitState, in that order (tests/foundation/test_summary.py).
STATE_ORDER: tuple[UnitState, ...] = ("failed", "not_run", "flaky", "skipped", "completed")
STAGE_ORDER: tuple[Stage, ...] = get_args(Stage)  # the order stages run in


def _counts(units: list[Unit]) -> str:
    parts = []
    for state in STATE_ORDER:
        n = sum(1 for u in units if u.state == state)
        if n:
            parts.append(f"{n} {state}")
    return ", ".join(parts) or "no units"


def _interesting(units: list[Unit]) -> list[Unit]:
    """Failed, flaky and skipped units: what a release engineer must read."""
    return sorted((u for u in units if u.state != "completed"), key=lambda u: (STATE_ORDER.index(u.state), u.id))


def _untested(run: RunManifest) -> list[str]:
    """First lines of every summary: variants published without their hardware's tests."""
    untested = run.info.get("published_untested") or {}
    return [f"PUBLISHED UNTESTED on its hardware: {variant} ({why})" for variant, why in sorted(dict(untested).items())]


def _heading(run: RunManifest) -> str:
    commit = str(run.info.get("commit") or "")
    return (f"run {run.run_id} ({run.flow}{', version ' + run.version if run.version else ''}"
            f"{', commit ' + commit[:12] if commit else ''})")


def install_command(index_url: str, install: dict[str, Any]) -> str:
    """The pip command that installs the project from ``index_url`` (options as ``kiln verify`` passes them)."""
    options = index_options("pip", index_url, install.get("extra_index_urls") or [])
    return " ".join(["pip", "install", *options, str(install.get("distribution", ""))])


def install_reason(install: dict[str, Any]) -> str:
    """Why the command names an extra index: a Kiln index holds only the project's own wheels."""
    names = ", ".join(_dependency_names(install.get("dependencies") or []))
    extras = install.get("extra_index_urls") or []
    if not names:
        return f"(the index holds {install.get('distribution')}, which has no dependencies)"
    if not extras:
        return (f"(the index holds only {install.get('distribution')}; its dependencies {names} must already be "
                "installed, or name an index for them in kiln.toml [publish] extra_index_urls)")
    return (f"(--extra-index-url: the index holds only {install.get('distribution')}; its dependencies {names} "
            f"are not on it and resolve from {', '.join(extras)})")


def _dependency_names(requirements: list[str]) -> list[str]:
    names = []
    for text in requirements:
        try:
            names.append(Requirement(text).name)
        except InvalidRequirement:  # kiln.toml validated it; a hand-edited run.json must not break the summary
            names.append(text)
    return names


def render_text(run: RunManifest) -> str:
    stages = [stage for stage in STAGE_ORDER if any(u.stage == stage for u in run.units)]
    lines = [_heading(run), *_untested(run), ""]
    width = max((len(s) for s in stages), default=5)
    for stage in stages:
        units = [u for u in run.units if u.stage == stage]
        lines.append(f"  {stage:<{width}}  {len(units):>4} units: {_counts(units)}")
    notable = _interesting(run.units)
    if notable:
        lines.append("")
        for unit in notable[:40]:
            first = unit.message.splitlines()[0] if unit.message else ""
            lines.append(f"  {unit.state.upper():<9} {unit.id}  {first}")
        if len(notable) > 40:
            lines.append(f"  … and {len(notable) - 40} more in {run.root / MANIFEST_NAME}")
    wheels = run.artifacts_of("wheel")
    if wheels:
        lines.append("")
        lines.extend(f"  wheel  {w.path}  sha256={w.sha256[:16]}…" for w in wheels)
    if run.info.get("publish_plan"):
        lines += ["", *("  " + line for line in str(run.info["publish_plan"]).splitlines())]
    install = run.info.get("install")
    shown = False
    for key, label in (("index_url", "index"), ("dry_run_index_url", "index (dry-run staging copy)")):
        urls = run.info.get(key) or []
        for url in [urls] if isinstance(urls, str) else urls:
            lines.append(f"  {label}: {url}")
            if isinstance(install, dict):
                lines.append(f"    install: {install_command(url, install)}")
                shown = True
    if shown:
        lines.append(f"    {install_reason(install)}")
    lines.append(f"\n  manifest: {run.root / MANIFEST_NAME}")
    return "\n".join(lines)


def render_markdown(run: RunManifest) -> str:
    lines = [f"# Kiln {run.flow} run `{run.run_id}`", ""]
    lines += [f"**{line}**\n" for line in _untested(run)]
    if run.version:
        commit = str(run.info.get("commit") or "")
        lines.append(f"Version: `{run.version}`" + (f", commit `{commit}`" if commit else "") + "\n")
    lines += ["| stage | units | states |", "|---|---|---|"]
    for stage in STAGE_ORDER:
        units = [u for u in run.units if u.stage == stage]
        if units:
            lines.append(f"| {stage} | {len(units)} | {_counts(units)} |")
    notable = _interesting(run.units)
    if notable:
        lines += ["", "## Needs attention", "", "| unit | state | message |", "|---|---|---|"]
        for unit in notable:
            message = (unit.message.splitlines()[0] if unit.message else "").replace("|", "\\|")
            lines.append(f"| `{unit.id}` | {unit.state} | {message} |")
    lines += _test_tables(run)
    urls = run.info.get("index_url") or []
    install = run.info.get("install")
    if urls:
        lines += ["", "## Published indexes", ""]
        for url in [urls] if isinstance(urls, str) else urls:
            lines.append(f"- <{url}>")
            if isinstance(install, dict):
                lines.append(f"  - `{install_command(url, install)}`")
        if isinstance(install, dict):
            lines += ["", install_reason(install)]
    return "\n".join(lines) + "\n"


def _test_tables(run: RunManifest) -> list[str]:
    """Links to each suite's table of failed, errored, timed-out and flaky tests (its test task's artifact)."""
    tables = {key[len(TEST_TABLE_INFO):]: value for key, value in run.info.items()
              if key.startswith(TEST_TABLE_INFO) and isinstance(value, dict)}
    if not tables:
        return []
    lines = ["", "## Test results", "", "| suite | result | failed, errored, timed-out, flaky |", "|---|---|---|"]
    for unit_id, table in sorted(tables.items()):
        count = int(table.get("problems") or 0)
        link = f"[{count} test{'s' if count != 1 else ''}]({table['url']})" if table.get("url") else str(count)
        summary = str(table.get("summary") or "").splitlines()[0:1]
        lines.append(f"| `{unit_id}` | {(summary[0] if summary else '').replace('|', chr(92) + '|')} | {link} |")
    return lines


def print_summary(out: Path) -> None:
    path = Path(out) / MANIFEST_NAME
    if path.exists():
        print(render_text(RunManifest.load(path)))
