"""The documentation site builds with ``mkdocs build --strict``: every page in the nav, every link and anchor resolves."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[test]' installs both)")
def test_the_site_builds_strictly_with_every_link_and_anchor_resolving(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    for page in ("index.html", "getting-started/index.html", "reference/kiln-toml/index.html",
                 "reference/cli/index.html", "explanation/architecture/index.html", "guides/build-cache/index.html"):
        assert (site / page).is_file(), page
    assert not any(site.rglob("*.md")), "a markdown file was copied as is: a page missing from the nav?"


def test_every_markdown_page_is_in_the_nav():
    import yaml

    def pages(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [p for value in entry.values() for p in pages(value)]
        if isinstance(entry, list):
            return [p for item in entry for p in pages(item)]
        return []

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    listed = set(pages(config["nav"]))
    present = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert present - listed == set(), "pages the nav does not list"
    assert listed - present == set(), "nav entries with no page"
