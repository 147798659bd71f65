"""Fixtures of the build-stage tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.project.config import KilnConfig, load_config
from tests.helpers.projects import copy_project


@pytest.fixture
def tiny_config(tmp_path: Path) -> KilnConfig:
    return load_config(copy_project("tiny", tmp_path))
