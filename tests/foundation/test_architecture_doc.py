"""docs/architecture.md stays true: every invariant the code cites exists there, every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SCANNED = ("flows", "tasks", "release", "kernels", "runtime", "tests", "benchmarks")
_CITED = re.compile(r"\binvariants? (\d+)", re.IGNORECASE)
_DEFINED = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)
_PATH = re.compile(r"`((?:flows|tasks|release|kernels|runtime|tests|benchmarks|docs)/[^`\s]*)`")


def _cited_invariants() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else ():
            for number in _CITED.findall(path.read_text(encoding="utf-8")):
                cited.setdefault(int(number), []).append(str(path.relative_to(ROOT)))
    return cited


def test_every_invariant_cited_in_the_code_is_defined_in_the_architecture_doc():
    defined = {int(n) for n in _DEFINED.findall(DOC.read_text(encoding="utf-8"))}
    cited = _cited_invariants()
    assert cited, "the scan found no citation at all: the pattern or the folders are wrong"
    missing = {n: where for n, where in cited.items() if n not in defined}
    assert missing == {}


def test_every_path_the_architecture_doc_names_exists():
    named = _PATH.findall(DOC.read_text(encoding="utf-8"))
    assert named
    assert [p for p in named if not (ROOT / p).exists()] == []
