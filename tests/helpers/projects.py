"""The fixture projects under tests/fixtures/projects, copied so a test may edit them."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "projects"


def copy_project(name: str, dest: Path) -> Path:
    """Copy a fixture project so a test may edit it; return its kiln.toml."""
    target = dest / name
    shutil.copytree(FIXTURES / name, target, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    return target / "kiln.toml"
