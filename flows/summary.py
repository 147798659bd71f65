"""The end-of-run summary: a terminal table and the run's markdown artifact.

Both are rendered from ``run.json`` alone, so what the terminal, the Prefect
UI and the manifest say about a run can never disagree.
"""

from __future__ import annotations

from pathlib import Path

from release.manifest import MANIFEST_NAME, RunManifest, Unit

STATE_ORDER = ("failed", "flaky", "skipped", "completed")
STAGE_ORDER = ("build", "test", "bench", "publish", "verify")


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


def render_text(run: RunManifest) -> str:
    stages = [stage for stage in STAGE_ORDER if any(u.stage == stage for u in run.units)]
    lines = [f"run {run.run_id} ({run.flow}{', version ' + run.version if run.version else ''})", ""]
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
    for key, label in (("index_url", "index"), ("dry_run_index_url", "index (dry-run staging copy)")):
        urls = run.info.get(key) or []
        for url in [urls] if isinstance(urls, str) else urls:
            lines.append(f"  {label}: {url}")
    lines.append(f"\n  manifest: {run.root / MANIFEST_NAME}")
    return "\n".join(lines)


def render_markdown(run: RunManifest) -> str:
    lines = [f"# Kiln {run.flow} run `{run.run_id}`", ""]
    if run.version:
        lines.append(f"Version: `{run.version}`\n")
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
    urls = run.info.get("index_url") or []
    if urls:
        lines += ["", "## Published indexes", ""]
        lines += [f"- <{url}>" for url in ([urls] if isinstance(urls, str) else urls)]
    return "\n".join(lines) + "\n"


def print_summary(out: Path) -> None:
    path = Path(out) / MANIFEST_NAME
    if path.exists():
        print(render_text(RunManifest.load(path)))
