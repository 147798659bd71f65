"""Fixtures for the tests of runs (versions, records, publishing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.gitrepo import git_project, tiny_cpu_only


@pytest.fixture
def tinycpu(tmp_path: Path) -> Path:
    """The tiny project with only its CPU variant, committed: kiln.toml."""
    return git_project("tiny", tmp_path, edit=tiny_cpu_only)
