"""The README's smallest kiln.toml for a Triton-only package is a valid configuration."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.tasks.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _readme_toml() -> str:
    section = (REPO / "README.md").read_text().split("## Onboarding your kernel package", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    return block


def test_the_readme_onboarding_config_loads_in_a_src_layout_project(tmp_path):
    (tmp_path / "kiln.toml").write_text(_readme_toml())
    (tmp_path / "src" / "mykernels").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    config = load_config(tmp_path / "kiln.toml")
    assert config.project.package == "mykernels" and config.project.distribution == "my-kernels"
    assert [v.name for v in config.variants] == ["cu130", "cpu"]
    assert config.variant("cu130").archs == ("9.0", "10.0")
    assert [s.name for s in config.suites] == ["unit"]
    assert config.path(config.project.source) == tmp_path / "src" / "mykernels"
