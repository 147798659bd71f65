"""Shared helpers for the build-stage tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.tasks.project.config import KilnConfig, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "projects"


def copy_project(name: str, dest: Path) -> Path:
    """Copy a fixture project so a test may edit it; return its kiln.toml."""
    target = dest / name
    shutil.copytree(FIXTURES / name, target, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    return target / "kiln.toml"


@pytest.fixture
def tiny_config(tmp_path: Path) -> KilnConfig:
    return load_config(copy_project("tiny", tmp_path))
