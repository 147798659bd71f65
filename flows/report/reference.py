"""The generated reference pages of the documentation: the ``kiln`` command line, rendered from the parser
the command itself uses (:func:`kiln.flows.cli.build_parser`), and ``kiln.toml``, rendered from the
configuration models (:mod:`kiln.tasks.project.config_reference`).

Regenerate both with ``python -m kiln.flows.report.reference``; ``--check`` exits 1 naming each stale page
(``tests/docs/test_reference.py`` runs the same check). Pure rendering: a width fixed here, not the
terminal's, so the pages are the same on every machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from kiln.core.fsutil import atomic_write_bytes
from kiln.flows.cli import build_parser
from kiln.tasks.project import config_reference

REGENERATE = "python -m kiln.flows.report.reference"
DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = {"reference/cli.md": "cli", "reference/kiln-toml.md": "config"}
_WIDTH = 100


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Each subcommand of ``parser`` with its one-line help, in the order the parser declares them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield helps.get(name, ""), sub


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _argument_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
        return None
    formatter = argparse.HelpFormatter(parser.prog, width=_WIDTH)
    name = ", ".join(action.option_strings) or str(action.metavar or action.dest)
    value = "" if action.nargs == 0 else formatter._format_args(action, action.dest.upper()) \
        if action.option_strings else ""
    help_text = formatter._expand_help(action) if action.help else "—"
    facts = []
    if action.required and action.option_strings:
        facts.append("required")
    if action.choices is not None:
        facts.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.default not in (None, False, argparse.SUPPRESS, []) and action.nargs != 0 \
            and "default" not in help_text:
        facts.append(f"default `{action.default}`")
    detail = f" ({'; '.join(facts)})" if facts else ""
    cell = " ".join(f"{help_text}{detail}".split()).replace("|", "\\|")
    flag = f"`{name} {value}`" if value else f"`{name}`"
    return f"| {flag} | {cell} |"


def _command_section(parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    lines += ["```text", _usage(parser), "```", ""]
    rows = [row for action in parser._actions if (row := _argument_row(parser, action))]
    if rows:
        lines += ["| argument | meaning |", "|---|---|", *rows, ""]
    for sub_summary, sub in _subcommands(parser):
        lines += _command_section(sub, sub_summary, level + 1)
    return lines


def render_cli(parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line reference page, markdown."""
    parser = parser or build_parser()
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated from kiln.flows.cli.build_parser (kiln.flows.report.reference); do not edit."
        f" Regenerate: {REGENERATE} -->",
        "",
        f"{parser.description} Every subcommand, its usage and every argument, generated from the parser"
        " `kiln` itself runs.",
        "",
        "| command | does |",
        "|---|---|",
    ]
    lines += [f"| [`{sub.prog}`](#{sub.prog.replace(' ', '-')}) | {summary} |" for summary, sub in _subcommands(parser)]
    lines.append("")
    for summary, sub in _subcommands(parser):
        lines += _command_section(sub, summary, 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def render(page: str) -> str:
    return render_cli() if PAGES[page] == "cli" else config_reference.render()


def stale(docs: Path = DOCS) -> list[str]:
    """The pages under ``docs`` whose committed text differs from what the code renders now."""
    return [page for page in PAGES if not (docs / page).is_file()
            or (docs / page).read_text(encoding="utf-8") != render(page)]


def write(docs: Path = DOCS) -> list[str]:
    """Render every page into ``docs``; the pages that changed."""
    changed = stale(docs)
    for page in changed:
        (docs / page).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(docs / page, render(page).encode("utf-8"))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Regenerate the reference pages of the docs.")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the documentation folder (default: this checkout's)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        pages = stale(args.docs)
        for page in pages:
            print(f"{args.docs / page} is stale; regenerate it with: {REGENERATE}", file=sys.stderr)
        return 1 if pages else 0
    for page in write(args.docs):
        print(f"wrote {args.docs / page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
