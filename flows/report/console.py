"""The console's per-variant table and install lines: the part of a run's ending that fits a screen.

One row per variant (or matrix cell) — its wheel, its tests (passed, failed,
suites not run, carried), whether it was published and to which index — then
one install command per variant's index, led, where the run published the
combined index of variant wheels, by its one command and ``kiln which`` for any
other environment. The long explanations (what each index holds, what the
wheel requires and where that comes from) stay in the run record, the Prefect
summary artifact and ``kiln which``. Rendered from ``run.json`` alone, as the
rest of the summary is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kiln.core.manifest import RunManifest, Unit
from kiln.flows.report.hint import install_command
from kiln.release.publish.plan import COMBINED
from kiln.tasks.run.coverage import COVERAGE_INFO

TABLE_WIDTH = 100  # the table's widest line: an 80-100 column terminal shows it unwrapped
HEADER = ("variant", "wheel", "tests", "published", "index")
_COUNT = re.compile(r"(\d+) (passed|flaky|failed|error|timeout|crashed|infrastructure)\b")
_CARRIED = re.compile(r"selection: \d+ run, (\d+) carried")
SELECTION_SUMMARY_INFO = "selection:"  # run info key prefix (+ unit id): what test selection ran and carried
_FAILING = ("failed", "error", "timeout", "crashed", "infrastructure")


@dataclass(frozen=True)
class Row:
    """What the table says of one variant."""

    variant: str
    wheel: str
    tests: str
    published: str
    index: str


def _index_urls(run: RunManifest) -> tuple[list[str], bool]:
    """The channel indexes the run published to (or staged, in a dry run), and whether it was a dry run."""
    for key, dry in (("index_url", False), ("dry_run_index_url", True)):
        urls = run.info.get(key) or []
        urls = [urls] if isinstance(urls, str) else [str(u) for u in urls] if isinstance(urls, list) else []
        if urls:
            return urls, dry
    return [], False


def variant_index(urls: list[str], variant: str) -> str:
    """The URL of ``variant``'s own channel index among ``urls`` (``…/<variant>/simple/``), or ''."""
    return next((url for url in urls if url.rstrip("/").endswith(f"/{variant}/simple")), "")


def _variants(run: RunManifest) -> list[str]:
    cells = run.info.get(COVERAGE_INFO)
    named = [str(row.get("variant")) for row in cells if isinstance(row, dict)] if isinstance(cells, list) else []
    found = {u.variant for u in run.units if u.variant} | {a.variant for a in run.artifacts if a.variant}
    return [*named, *sorted(v for v in found if v not in named and v != COMBINED)]


def _wheel(run: RunManifest, variant: str) -> str:
    builds = [u for u in run.units if u.stage == "build" and u.variant == variant]
    failed = sum(1 for u in builds if u.state == "failed")
    if failed:
        return f"FAILED {failed}/{len(builds)}"
    if any(a.kind == "wheel" and a.variant == variant and a.state == "ok" for a in run.artifacts):
        return "built"
    return "none" if builds else "-"


def _carried(run: RunManifest, unit: Unit) -> int:
    lines = run.info.get(f"{SELECTION_SUMMARY_INFO}{unit.id}")
    found = _CARRIED.search(str(lines[0])) if isinstance(lines, list) and lines else None
    return int(found.group(1)) if found else 0


def _tests(run: RunManifest, variant: str) -> str:
    """``9 passed, 1 failed, 1 suite not run, 3 carried`` (zeros left out): a suite without a variant counts for all."""
    suites = [u for u in run.units if u.stage == "test" and u.variant in (variant, None)]
    if not suites:
        return "no suite"
    passed = failed = carried = 0
    for unit in suites:
        head = unit.message.split(" (", 1)[0] if unit.state != "not_run" else ""
        counts = [(int(n), outcome) for n, outcome in _COUNT.findall(head)]
        unit_carried = _carried(run, unit)
        carried += unit_carried
        passed += sum(n for n, outcome in counts if outcome in ("passed", "flaky")) - unit_carried
        failed += sum(n for n, outcome in counts if outcome in _FAILING)
        if unit.state == "failed" and not counts:  # a suite that failed before any test ran
            failed += 1
    not_run = sum(1 for u in suites if u.state == "not_run")
    parts = [f"{passed} passed" if passed else "", f"{failed} failed" if failed else "",
             f"{not_run} suite{'s' if not_run != 1 else ''} not run" if not_run else "",
             f"{carried} carried" if carried else ""]
    return ", ".join(p for p in parts if p) or "0 tests"


def _published(run: RunManifest, variant: str, index: str, dry: bool) -> str:
    if index:
        if dry:
            return "dry run"
        untested = run.info.get("published_untested")
        return "untested" if isinstance(untested, dict) and variant in untested else "yes"
    held = [u for u in run.units if u.stage == "publish" and u.variant == variant and u.state in ("skipped", "failed")]
    return "held" if held else "no"


def _short(url: str, root: str) -> str:
    return url[len(root):] if root and url.startswith(root) else url


def _channel_of(url: str) -> str:
    """``…/nightly/cpu/simple/`` → ``…/nightly/``: an index's URL less its variant and ``simple``."""
    head = url.rstrip("/")
    for _ in range(2):
        head = head[:head.rfind("/")] if "/" in head else head
    return head + "/"


def index_root(urls: list[str]) -> str:
    """Where the run's indexes are: the common part of their channel URLs, ending in '/'."""
    channels = [_channel_of(url) for url in urls]
    if not channels:
        return ""
    head = channels[0]
    for channel in channels[1:]:
        while not channel.startswith(head):
            head = head[:-1]
    return head[:head.rfind("/") + 1]


def rows(run: RunManifest) -> list[Row]:
    urls, dry = _index_urls(run)
    root = index_root(urls)
    table = []
    for variant in _variants(run):
        index = variant_index(urls, variant)
        table.append(Row(variant, _wheel(run, variant), _tests(run, variant), _published(run, variant, index, dry),
                         _short(index, root) or "-"))
    return table


def _fit(cells: list[list[str]], width: int) -> list[str]:
    """Aligned columns; the last column is cut (with '…') where a line would pass ``width``."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    lines = []
    for row in cells:
        line = "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    return [line.rstrip() for line in lines]


def table_lines(run: RunManifest, width: int = TABLE_WIDTH) -> list[str]:
    """The table: a header and one row per variant, each line at most ``width`` characters."""
    found = rows(run)
    if not found:
        return []
    cells = [list(HEADER), *([r.variant, r.wheel, r.tests, r.published, r.index] for r in found)]
    return _fit(cells, width)


def install_lines(run: RunManifest) -> list[str]:
    """The combined index's one command (uv) and ``kiln which`` for any other environment, where the run published
    it; then one command per variant's own index (pip)."""
    install: Any = run.info.get("install")
    urls, dry = _index_urls(run)
    if not isinstance(install, dict) or not urls:
        return []
    indexes = install.get("indexes") or {}
    combined = [url for url in urls if isinstance(indexes.get(url), dict) and indexes[url].get("variants")]
    root, staged = index_root(urls), " (the dry run's staging copy)" if dry else ""
    lines = [f"  index: {root}{staged}"]
    if combined:
        lines += [f"  install (uv picks this machine's variant): {install_command(combined[0], install)}",
                  f"  any other environment: kiln which {combined[0]} --python X.Y --platform TAG"]
    for variant in _variants(run):  # pip, which knows no variant wheels, takes each variant's own index
        url = variant_index(urls, variant)
        if url and isinstance(indexes.get(url), dict) and indexes[url].get("version"):
            lines.append(f"  install {variant}: {install_command(url, install)}")
    return lines
