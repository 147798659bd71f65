from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "benchproj"


@pytest.fixture
def benchproj(tmp_path: Path) -> Path:
    """A fresh copy of the torch-only bench project; returns its kiln.toml."""
    root = tmp_path / "benchproj"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root / "kiln.toml"
