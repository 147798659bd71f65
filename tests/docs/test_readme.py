"""The README is the front door, not the manual: two screens at most, the two set-up commands first, links that resolve."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SCREEN_ROWS, COLUMNS = 50, 120


def test_the_readme_fits_in_two_screens_at_120_columns():
    rows = sum(max(1, len(textwrap.wrap(line, COLUMNS))) for line in README.read_text(encoding="utf-8").split("\n"))
    assert rows <= 2 * SCREEN_ROWS, f"README.md wraps to {rows} rows at {COLUMNS} columns; move detail into docs/"


def test_the_two_set_up_commands_are_the_readmes_first_code():
    """CI runs the first (.ci/first_run.py) and the second (.ci/run greps it): they lead the README, in that order."""
    code = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("    ")]
    assert len(code) >= 2
    assert code[0].startswith("    python3 -m venv") and code[0].endswith("kiln nightly --out out")
    assert code[1].startswith("    python3 -m venv") and "pytest" in code[1]


def test_every_link_in_the_readme_resolves_to_a_file_of_the_checkout():
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    local = [t.split("#", 1)[0] for t in targets if not t.startswith(("http://", "https://"))]
    assert any(t.startswith("docs/") for t in local)
    assert [t for t in local if t and not (REPO / t).exists()] == []


def test_getting_started_quotes_the_readmes_two_commands_exactly():
    """The docs repeat the set-up; CI proves the README's, so the page must say the very same commands."""
    readme = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("    python3 -m venv")]
    page = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) == 2
    assert [line for line in page if line.startswith("    python3 -m venv")] == readme
