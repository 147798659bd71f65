"""Every example in the docs and the README works: each TOML block loads with Kiln's own config loader, and each
``kiln …`` command in a code block parses with the parser ``kiln`` itself runs.

A TOML block is a whole ``kiln.toml`` unless the line before it marks it: ``<!-- kiln.toml fragment … -->`` is
merged into a minimal ``kiln.toml`` and loaded; ``<!-- toml excerpt: REASON -->`` is lines of a file, only
parsed as TOML (the reason says what checks it).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import ConfigError
from kiln.flows.cli import build_parser
from kiln.tasks.project.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FRAGMENT, EXCERPT = "<!-- kiln.toml fragment", "<!-- toml excerpt:"
BASE = """
[project]
package = "mykernels"
distribution = "my-kernels"
version = "0.1.0"
source = "src/mykernels"
registry = "mykernels.registry:registry"

[[variants]]
name = "cu130"
backend = "cuda"
archs = ["9.0"]

[[variants]]
name = "cpu"
backend = "cpu"

[publish]
default_target = "local"

[publish.targets.local]
url = "file://.kiln/index"
"""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    kind: str  # "whole", "fragment" or "excerpt"
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def toml_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if line.strip() != "```toml":
                continue
            end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
            before = next((lines[i].strip() for i in range(number - 1, -1, -1) if lines[i].strip()), "")
            kind = "fragment" if before.startswith(FRAGMENT) else "excerpt" if before.startswith(EXCERPT) else "whole"
            blocks.append(Block(page, number + 1, kind, "\n".join(lines[number + 1:end]) + "\n"))
    return blocks


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``: tables merge key by key, arrays of tables ([[variants]]) replace the base's."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _make_paths(root: Path, data: dict[str, Any]) -> None:
    """The paths a kiln.toml names, as the loader checks them: the package, the suites' tests, a pep517 project."""
    (root / data["project"]["source"]).mkdir(parents=True, exist_ok=True)
    for suite in data.get("suites", []):
        for path in suite.get("paths", []):
            (root / path).mkdir(parents=True, exist_ok=True)
    build = data.get("build", {})
    if build.get("backend") == "pep517":
        project_dir = root / build.get("project_dir", ".")
        project_dir.mkdir(parents=True, exist_ok=True)
        (project_dir / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    pins = data.get("publish", {}).get("pins")
    if pins:
        (root / pins).parent.mkdir(parents=True, exist_ok=True)
        (root / pins).write_text("")


BLOCKS = toml_blocks()


def test_the_docs_have_toml_examples_of_every_kind():
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("whole") >= 2 and kinds.count("fragment") >= 3, kinds
    assert all(b.kind != "excerpt" or "checks" in b.page.read_text() for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_toml_example_loads_with_kilns_loader(block, tmp_path):
    data = tomllib.loads(block.text)  # every block is TOML, excerpts too
    if block.kind == "excerpt":
        return
    if block.kind == "fragment":
        data = _merge(tomllib.loads(BASE), data)
    _make_paths(tmp_path, data)
    try:
        if block.kind == "whole":
            (tmp_path / "kiln.toml").write_text(block.text)
            load_config(tmp_path / "kiln.toml")
        else:
            parse_config(data, tmp_path, source=str(block))
    except ConfigError as exc:
        pytest.fail(f"the TOML example at {block} does not load: {exc}")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


_SPLIT = re.compile(r"\s(?:&&|\|\||;|\|)\s")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_KILN = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*kiln\s+[a-z]")


def _code_blocks(lines: list[str]) -> list[list[tuple[int, str]]]:
    """Indented and fenced (non-TOML, non-C++) code blocks, each as (line number, text) pairs."""
    blocks: list[list[tuple[int, str]]] = []
    fence: str | None = None
    current: list[tuple[int, str]] = []
    for number, line in enumerate(lines, start=1):
        if fence is not None:
            if line.strip() == "```":
                if fence in ("", "bash", "sh", "console", "shell"):  # ```text: usage syntax, not a command
                    blocks.append(current)
                fence, current = None, []
            else:
                current.append((number, line))
        elif line.startswith("```"):
            if current:
                blocks.append(current)
            fence, current = line.strip()[3:], []
        elif line.startswith("    ") and not line.lstrip().startswith(("- ", "|")):
            if current and current[-1][0] != number - 1:
                blocks.append(current)
                current = []
            current.append((number, line[4:]))
    if current and fence is None:
        blocks.append(current)
    return blocks


def kiln_commands() -> list[Command]:
    found = []
    for page in PAGES:
        for block in _code_blocks(page.read_text(encoding="utf-8").splitlines()):
            transcript = any(text.startswith("$ ") for _, text in block)  # then the other lines are output
            joined: list[tuple[int, str]] = []
            for number, text in block:
                if joined and joined[-1][1].endswith("\\"):
                    joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + text.strip())
                elif not transcript or text.startswith("$ "):
                    joined.append((number, text.removeprefix("$ ")))
            for number, text in joined:
                for segment in _SPLIT.split(text):
                    if _KILN.match(segment):  # only what runs kiln is shell here; the rest may be output
                        words = shlex.split(segment, comments=True)
                        while words and _ASSIGNMENT.match(words[0]):
                            words = words[1:]
                        found.append(Command(page, number, tuple(words)))
    return found


COMMANDS = kiln_commands()


def test_the_command_scan_finds_the_readme_nightly_and_the_docs_examples():
    assert any(c.page.name == "README.md" and c.words[:2] == ("kiln", "nightly") for c in COMMANDS)
    assert {c.words[1] for c in COMMANDS} >= {"nightly", "init", "release", "history", "bisect", "which", "server"}


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_kiln_command_example_parses(command):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(list(command.words[1:]))
    except SystemExit as exc:
        pytest.fail(f"{command}: {shlex.join(command.words)} does not parse (exit {exc.code}): {err.getvalue()}")
