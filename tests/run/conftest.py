"""Fixtures for the tests of runs (versions, records, publishing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.gitrepo import git_project


@pytest.fixture
def tinycpu(tmp_path: Path) -> Path:
    """The tiny project with only its CPU variant, committed: kiln.toml."""
    def cpu_only(repo: Path) -> None:
        text = (repo / "kiln.toml").read_text()
        head, _, rest = text.partition("[[variants]]")
        cpu = '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n\n'
        (repo / "kiln.toml").write_text(head + cpu + rest[rest.index("[build]"):])

    return git_project("tiny", tmp_path, edit=cpu_only)
