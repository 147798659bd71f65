"""The end-of-run summary: a terminal table and the run's markdown artifact.

Both are rendered from ``run.json`` alone, so what the terminal, the Prefect
UI and the manifest say about a run can never disagree. What a person must act
on comes first: variants published untested, a version an extra index
outranks, then failures (with the end of their log), suites that did not run
and untested publications; skips the arch filter made on purpose are one line
per reason, the full table behind a link. The install hints state what each
index holds and what the published wheel requires (:mod:`kiln.tasks.install_hint`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from kiln.core.manifest import MANIFEST_NAME, RunManifest, Stage, Unit, UnitState
from kiln.core.sandbox import CONFINEMENT_INFO
from kiln.flows.report.console import SELECTION_SUMMARY_INFO, install_lines, table_lines
from kiln.flows.report.hint import first_lines, install_command, install_reason
from kiln.tasks.run.coverage import COVERAGE_INFO
from kiln.tasks.testing.shards import balance_lines

TEST_TABLE_INFO = "test_table:"  # run info key prefix (+ unit id) of a suite's problem-test table
QUARANTINE_INFO = "quarantine:"  # run info key prefix (+ unit id): the quarantine lines of a suite's run
BENCH_TREND_INFO = "bench_trend"  # run info key: one line per benchmark case, its recent medians and the policy
# What a release engineer must read first; every UnitState, in that order (tests/flows/test_summary.py).
STATE_ORDER: tuple[UnitState, ...] = ("failed", "not_run", "flaky", "skipped", "completed")
STAGE_ORDER: tuple[Stage, ...] = get_args(Stage)  # the order stages run in
TAIL_LINES = 6  # of a failure's log, under its line
MAX_LISTED = 40
_QUOTED = re.compile(r"'[^']*'")
_DETAIL = re.compile(r" \([^()]*\)$")  # the names and places after a skip reason
_COUNTED = re.compile(r"^\d+ units? skipped: ")

__all__ = ["BENCH_TREND_INFO", "COVERAGE_INFO", "QUARANTINE_INFO",
           "SELECTION_SUMMARY_INFO", "STAGE_ORDER", "STATE_ORDER", "TEST_TABLE_INFO",
           "coverage_markdown", "install_command", "install_reason", "print_summary",
           "render_console", "render_markdown", "render_text", "skip_reasons"]


def _counts(units: list[Unit]) -> str:
    parts = []
    for state in STATE_ORDER:
        n = sum(1 for u in units if u.state == state)
        if n:
            parts.append(f"{n} {state}")
    return ", ".join(parts) or "no units"


@dataclass(frozen=True)
class Attention:
    """One row of "Needs attention": a unit that failed, did not run or was flaky, or a publication untested."""

    label: str
    id: str
    message: str
    tail: tuple[str, ...] = ()  # the last lines of a failure's log


def _tail(message: str) -> tuple[str, ...]:
    rest = [line.rstrip() for line in message.splitlines()[1:] if line.strip()]
    return tuple(rest[-TAIL_LINES:])


def attention(run: RunManifest) -> list[Attention]:
    """Failures (with their log's last lines), suites not run, flaky units, then untested publications."""
    units = sorted((u for u in run.units if u.state in ("failed", "not_run", "flaky")),
                   key=lambda u: (STATE_ORDER.index(u.state), u.id))
    rows = [Attention(u.state, u.id, _first(u.message), _tail(u.message) if u.state == "failed" else ())
            for u in units]
    for key in ("published_untested", "published_without_suite"):
        recorded = run.info.get(key)
        for variant, why in sorted(recorded.items() if isinstance(recorded, dict) else []):
            rows.append(Attention("untested", f"publish/{variant}", f"published untested: {why}"))
    for where, record in confinement_records(run).items():  # a kernel that could not confine package code
        if record.get("gaps"):
            rows.append(Attention("unconfined", where, "package code ran without "
                                  + "; ".join(str(gap) for gap in record["gaps"])))
    return rows


def confinement_records(run: RunManifest) -> dict[str, dict[str, Any]]:
    """Each step's record of how it confined package code (``<stage>@<host>``: Landlock, namespaces, gaps)."""
    return {key[len(CONFINEMENT_INFO):]: value for key, value in sorted(run.info.items())
            if key.startswith(CONFINEMENT_INFO) and isinstance(value, dict)}


def confinement_lines(run: RunManifest) -> list[str]:
    """One line per step that ran package code: how its machine confined it."""
    lines = []
    for where, record in confinement_records(run).items():
        network = {"none": "no network", "loopback": "its own loopback only"}.get(str(record.get("network")),
                                                                                 "the host's network")
        how = (f"Landlock ABI {record.get('landlock_abi')}, " if record.get("landlock_abi") else "no Landlock, ") \
            + (f"namespaces of its own ({network})" if record.get("namespaces") else "no namespaces of its own")
        lines.append(f"{where}: {how}" + (" — NOT fully confined" if record.get("gaps") else ""))
    return lines


def _first(message: str) -> str:
    return message.splitlines()[0] if message else ""


def skip_reasons(units: Iterable[Unit]) -> list[str]:
    """Skipped units, one line per reason (quoted names left out of the reason, listed after it), most first."""
    groups: dict[str, list[Unit]] = {}
    for unit in units:
        if unit.state == "skipped":
            groups.setdefault(_QUOTED.sub("'…'", _first(unit.message)), []).append(unit)
    lines = []
    for reason, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        names = sorted({n.strip("'") for u in members for n in _QUOTED.findall(_first(u.message))})
        where = sorted({f"{u.variant} {u.arch}" if u.arch else str(u.variant) for u in members if u.variant})
        detail = "; ".join(part for part in (_some(names), _some(where)) if part)
        n = len(members)
        lines.append(f"{n} unit{'s' if n != 1 else ''} skipped: {reason or 'no reason given'}"
                     + (f" ({detail})" if detail else ""))
    return lines


def _some(items: list[str], shown: int = 3) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _heading(run: RunManifest) -> str:
    commit = str(run.info.get("commit") or "")
    return (f"run {run.run_id} ({run.flow}{', version ' + run.version if run.version else ''}"
            f"{', commit ' + commit[:12] if commit else ''})")


def _urls(run: RunManifest, key: str) -> list[str]:
    urls = run.info.get(key) or []
    return [urls] if isinstance(urls, str) else [str(u) for u in urls] if isinstance(urls, list) else []


def _text_attention(run: RunManifest) -> list[str]:
    rows, skips = attention(run), skip_reasons(run.units)
    lines = [""] if rows or skips else []
    for row in rows[:MAX_LISTED]:
        lines.append(f"  {row.label.upper():<9} {row.id}  {row.message}")
        lines.extend(f"  {'':<9}   | {line}" for line in row.tail)
    if len(rows) > MAX_LISTED:
        lines.append(f"  … and {len(rows) - MAX_LISTED} more in {run.root / MANIFEST_NAME}")
    lines += [f"  {'SKIPPED':<9} {line}" for line in skips]
    return lines


def quarantine_lines(run: RunManifest) -> list[str]:
    """What each suite's run said about quarantined tests: excused failures first, then changes to the list."""
    lines = [str(line) for key, value in sorted(run.info.items()) if key.startswith(QUARANTINE_INFO)
             and isinstance(value, list) for line in value]
    return sorted(lines, key=lambda line: not line.startswith("quarantined: "))


def selection_lines(run: RunManifest) -> list[str]:
    """Per suite unit: tests run, carried (from which run) and the device-seconds not spent; recall misses first."""
    lines = [str(line) for key, value in sorted(run.info.items()) if key.startswith(SELECTION_SUMMARY_INFO)
             and isinstance(value, list) for line in value]
    return sorted(lines, key=lambda line: not line.startswith("SELECTION RECALL MISS"))


def trend_lines(run: RunManifest) -> list[str]:
    """Each benchmark case's medians over the last runs and the regression policy's decision."""
    recorded = run.info.get(BENCH_TREND_INFO)
    return [str(line) for line in recorded] if isinstance(recorded, list) else []


def _text_sections(run: RunManifest) -> list[str]:
    lines = []
    for title, found in (("quarantine", quarantine_lines(run)),
                         ("test selection", selection_lines(run)), ("benchmark trend", trend_lines(run)),
                         ("shards", balance_lines(run.units)), ("package code sandbox", confinement_lines(run))):
        if found:
            lines += ["", f"  {title}:", *(f"    {line}" for line in found)]
    return lines


def _text_indexes(run: RunManifest) -> list[str]:
    install = run.info.get("install")
    lines = []
    for key, label in (("index_url", "index"), ("commit_index_url", "this commit's index"),
                       ("dry_run_index_url", "index (dry-run staging copy)"),
                       ("dry_run_commit_index_url", "this commit's index (dry-run staging copy)")):
        for url in _urls(run, key):
            lines.append(f"  {label}: {url}")
            if isinstance(install, dict):
                lines += [f"    install: {install_command(url, install)}", f"    {install_reason(url, install)}"]
    return lines


def render_text(run: RunManifest) -> str:
    stages = [stage for stage in STAGE_ORDER if any(u.stage == stage for u in run.units)]
    lines = [_heading(run), *first_lines(run.info), ""]
    width = max((len(s) for s in stages), default=5)
    for stage in stages:
        units = [u for u in run.units if u.stage == stage]
        lines.append(f"  {stage:<{width}}  {len(units):>4} units: {_counts(units)}")
    lines += _text_attention(run)
    lines += _text_coverage(run)
    lines += _text_sections(run)
    wheels = run.artifacts_of("wheel")
    if wheels:
        lines.append("")
        lines.extend(f"  wheel  {w.path}  sha256={w.sha256[:16]}…" for w in wheels)
    if run.info.get("publish_plan"):
        lines += ["", *("  " + line for line in str(run.info["publish_plan"]).splitlines())]
    if run.info.get("upload_plan"):  # a release's plan for PyPI-compatible indexes (kiln.flows.pypi)
        lines += ["", *("  " + line for line in str(run.info["upload_plan"]).splitlines())]
    lines += _text_indexes(run)
    lines.append(f"\n  manifest: {run.root / MANIFEST_NAME}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_attention(run: RunManifest, units_table: str) -> list[str]:
    rows, skips = attention(run), skip_reasons(run.units)
    if not rows and not skips:
        return []
    lines = ["", "## Needs attention", ""]
    if rows:
        lines += ["| unit | state | message |", "|---|---|---|"]
        lines += [f"| `{row.id}` | {row.label} | {_cell(row.message)} |" for row in rows]
    if skips:
        where = f"[the table of every unit]({units_table})" if units_table else f"`{MANIFEST_NAME}` of the run"
        lines += ["", f"Skipped on purpose (every unit and its reason: {where}):", ""]
        lines += [f"- {line}" for line in skips]
    for row in (r for r in rows if r.tail):
        body = "\n".join(row.tail).replace("```", "'''")
        lines += ["", f"`{row.id}` — {row.message} — its log ends:", "", "```text", body, "```"]
    return lines


def render_markdown(run: RunManifest, units_table: str = "") -> str:
    """The run's markdown summary; ``units_table``: the address of the table artifact of every unit."""
    lines = [f"# Kiln {run.flow} run `{run.run_id}`", ""]
    lines += [f"**{line}**\n" for line in first_lines(run.info)]
    if run.version:
        commit = str(run.info.get("commit") or "")
        lines.append(f"Version: `{run.version}`" + (f", commit `{commit}`" if commit else "") + "\n")
    lines += ["| stage | units | states |", "|---|---|---|"]
    for stage in STAGE_ORDER:
        units = [u for u in run.units if u.stage == stage]
        if units:
            lines.append(f"| {stage} | {len(units)} | {_counts(units)} |")
    lines += _markdown_attention(run, units_table)
    lines += _test_tables(run)
    lines += _markdown_sections(run)
    lines += _markdown_indexes(run)
    return "\n".join(lines) + "\n"


def coverage_markdown(run: RunManifest) -> list[str]:
    """The coverage section: one row per requested cell (:mod:`kiln.tasks.run.coverage`), as the run recorded it."""
    rows = run.info.get(COVERAGE_INFO)
    if not isinstance(rows, list) or not rows:
        return []
    lines = ["", "## Coverage", "", "| cell | Python | torch | backend | platform | archs | wheel | state | why |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row.get(k, "") for k in ("variant", "python", "torch", "backend", "platform", "archs", "wheel",
                                          "state", "why")]
        lines.append("| " + " | ".join(_cell(str(c)) for c in cells) + " |")
    return lines


def _text_coverage(run: RunManifest) -> list[str]:
    rows = run.info.get(COVERAGE_INFO)
    if not isinstance(rows, list) or not rows:
        return []
    width = max(len(str(row.get("variant", ""))) for row in rows)
    return ["", "  coverage:", *(f"    {row.get('variant', ''):<{width}}  {row.get('state', ''):<9}  "
                                 f"python {row.get('python', '')}, torch {row.get('torch', '')}, "
                                 f"{row.get('backend', '')} [{row.get('archs', '')}] {row.get('platform', '-')}"
                                 f"  {row.get('wheel', '')}"
                                 f"  — {row.get('why', '')}" for row in rows)]


def _markdown_sections(run: RunManifest) -> list[str]:
    lines = coverage_markdown(run)
    quarantined = quarantine_lines(run)
    if quarantined:
        lines += ["", "## Quarantined tests", "", *(f"- {_cell(line)}" for line in quarantined)]
    selected = selection_lines(run)
    if selected:
        lines += ["", "## Test selection", "", *(f"- {_cell(line)}" for line in selected)]
    trend = trend_lines(run)
    if trend:
        lines += ["", "## Benchmark trend", "", "```text", *trend, "```"]
    balance = balance_lines(run.units)
    if balance:
        lines += ["", "## Shards", "", *(f"- {_cell(line)}" for line in balance)]
    sandbox = confinement_lines(run)
    if sandbox:
        lines += ["", "## Package code sandbox", "", *(f"- {_cell(line)}" for line in sandbox)]
    return lines


def _markdown_indexes(run: RunManifest) -> list[str]:
    urls, commits, install = _urls(run, "index_url"), _urls(run, "commit_index_url"), run.info.get("install")
    if not urls and not commits:
        return []
    lines = ["", "## Published indexes", ""]
    for url, label in [*((u, "") for u in urls), *((u, "this commit's wheels only: ") for u in commits)]:
        lines.append(f"- {label}<{url}>")
        if isinstance(install, dict):
            lines += [f"  - `{install_command(url, install)}`", f"  - {install_reason(url, install)}"]
    return lines


def _test_tables(run: RunManifest) -> list[str]:
    """Links to each suite's table of failed, errored, timed-out and flaky tests (its test task's artifact)."""
    tables: dict[str, Any] = {key[len(TEST_TABLE_INFO):]: value for key, value in run.info.items()
                              if key.startswith(TEST_TABLE_INFO) and isinstance(value, dict)}
    if not tables:
        return []
    lines = ["", "## Test results", "", "| suite | result | failed, errored, timed-out, flaky |", "|---|---|---|"]
    for unit_id, table in sorted(tables.items()):
        count = int(table.get("problems") or 0)
        link = f"[{count} test{'s' if count != 1 else ''}]({table['url']})" if table.get("url") else str(count)
        summary = str(table.get("summary") or "").splitlines()[0:1]
        lines.append(f"| `{unit_id}` | {_cell(summary[0] if summary else '')} | {link} |")
    return lines


CONSOLE_ATTENTION = 5  # rows of "needs attention" the console ending shows; the rest are in the record
CONSOLE_TAILS = 1  # failures whose log's last lines it shows
CONSOLE_MESSAGE = 160  # characters of a message it shows
CONSOLE_COLUMNS = 120  # a line it cuts to one terminal row (the skips)


def _console_attention(run: RunManifest) -> list[str]:
    # an untested publication already heads the ending (first_lines)
    rows, skips = [row for row in attention(run) if row.label != "untested"], skip_reasons(run.units)
    lines = []
    for n, row in enumerate(rows[:CONSOLE_ATTENTION]):
        message = row.message if len(row.message) <= CONSOLE_MESSAGE else row.message[:CONSOLE_MESSAGE - 1] + "…"
        lines.append(f"  {row.label.upper():<9} {row.id}  {message}")
        lines.extend(f"  {'':<9}   | {line}" for line in (row.tail[-3:] if n < CONSOLE_TAILS else ()))
    # skips the arch filter made on purpose: one terminal row of "reason ×6"; which units and where are in the
    # record and the artifact
    reasons = [f"{_COUNTED.sub('', _DETAIL.sub('', line))} ×{line.split(' ', 1)[0]}" for line in skips]
    lines += [_row(f"  {'SKIPPED':<9} {'; '.join(reasons)}")] if skips else []
    left = max(len(rows) - CONSOLE_ATTENTION, 0)
    if left:
        lines.append(f"  … and {left} more (every unit: the run's summary in the Prefect UI, or {MANIFEST_NAME})")
    return ["", *lines] if lines else []


def _row(line: str, width: int = CONSOLE_COLUMNS) -> str:
    return line if len(line) <= width else line[:width - 1] + "…"


def _console_plans(run: RunManifest) -> list[str]:
    """A release's upload plan (a few rows per target); the channel's file list only for a dry run (its output)."""
    plans = [str(run.info["upload_plan"])] if run.info.get("upload_plan") else []
    if "dry run" in str(run.info.get("publish_plan") or "").split("\n", 1)[0]:
        plans.insert(0, str(run.info["publish_plan"]))
    return [line for plan in plans for line in ("", *("  " + row for row in plan.strip().splitlines()))]


def _unfinished(units: list[Unit]) -> str:
    """``2 failed, 1 skipped``: the units of a stage that did not complete, by state; '' when all did."""
    rest = [u for u in units if u.state != "completed"]
    return _counts(rest) if rest else ""


def render_console(run: RunManifest) -> str:
    """What a run's command prints at its end, one screen: the stages' counts, what needs attention, one row per
    variant (:mod:`kiln.flows.report.console`) and its install command. :func:`render_text` is the whole text form."""
    stages = [(stage, [u for u in run.units if u.stage == stage]) for stage in STAGE_ORDER]
    counts = "; ".join(f"{stage} {len(units)}" + (f" ({_unfinished(units)})" if _unfinished(units) else "")
                       for stage, units in stages if units)
    counts += "; the rest completed" if any(_unfinished(units) for _, units in stages) else ", all completed"
    lines = [_heading(run), *first_lines(run.info), "", f"  units: {counts or 'none'}"]
    lines += _console_attention(run)
    lines += ["", *table_lines(run)]
    lines += _console_plans(run)
    lines += install_lines(run)  # under the table: its index column is relative to their "index:" line
    lines.append(f"  manifest: {run.root / MANIFEST_NAME}")
    return "\n".join(lines)


def print_summary(out: Path, full: bool = False) -> None:
    """The run's ending on the console: one screen (:func:`render_console`), or with ``full`` the whole text
    form (:func:`render_text`)."""
    path = Path(out) / MANIFEST_NAME
    if path.exists():
        run = RunManifest.load(path)
        print(render_text(run) if full else render_console(run))
