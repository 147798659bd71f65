"""docs/explanation/architecture.md stays true: every invariant the code cites exists there, every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "explanation" / "architecture.md"
SCANNED = ("core", "flows", "tasks", "release", "kernels", "runtime", "tests", "benchmarks")
_CITED = re.compile(r"\binvariants? (\d+)", re.IGNORECASE)
_DEFINED = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)
_PATH = re.compile(r"`((?:core|flows|tasks|release|kernels|runtime|tests|benchmarks|docs)/[^`\s]*)`")


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


_FLOW = re.compile(r"^@flow\(name=\"([^\"]+)\"", re.MULTILINE)
# Kiln's own packages; kernels/ and runtime/ are distributions of their own, named by their top folder.
_PACKAGE_ROOTS = ("core", "flows", "tasks", "release")


def _package_folders() -> list[str]:
    folders = [top for top in ("kernels", "runtime") if (ROOT / top).is_dir()]
    for top in _PACKAGE_ROOTS:
        if (ROOT / top).is_dir():
            folders += sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / top).rglob("__init__.py"))
    return folders


def test_the_map_names_every_package_folder_and_every_flow():
    """One map: a newcomer finds every package and every flow in docs/explanation/architecture.md."""
    named = _PATH.findall(DOC.read_text(encoding="utf-8"))
    folders = _package_folders()
    assert "tasks/build" in folders and "flows/local" in folders  # the scan sees nested packages
    unnamed = [f for f in folders if not any(p == f + "/" or p.startswith(f + "/") for p in named)]
    assert unnamed == [], f"package folders docs/explanation/architecture.md does not name: {unnamed}"
    flows = {path.relative_to(ROOT).as_posix(): _FLOW.findall(path.read_text(encoding="utf-8"))
             for path in sorted((ROOT / "flows").glob("*.py"))}
    flow_files = [path for path, names in flows.items() if names]
    assert "flows/nightly.py" in flow_files
    assert [p for p in flow_files if p not in named] == [], "every file defining a flow is named"


def test_the_readme_links_the_map_at_its_top():
    head = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    assert "docs/explanation/architecture.md" in head
