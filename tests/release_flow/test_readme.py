"""The deploy-and-release guide (docs/guides/deploying.md) agrees with prefect.yaml and the CLI (no server needed).

:mod:`tests.release_flow.test_server` runs the same commands against a real
server; these checks catch a guide that falls behind prefect.yaml at once.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guides" / "deploying.md"
SECTION = "# Deploying the schedule and triggering a release"


def readme_commands() -> list[list[str]]:
    """Every command of the deploy-and-release guide, in order, as shell words (comments dropped)."""
    text = GUIDE.read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line.strip(), comments=True) for line in section.splitlines()
            if line.startswith("    ") and line.strip()]


def test_the_readme_creates_every_work_pool_that_prefect_yaml_deploys_onto():
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    needed = {d["work_pool"]["name"] for d in deployments}
    created = {words[3] for words in readme_commands() if words[:3] == ["prefect", "work-pool", "create"]}
    assert needed <= created, f"prefect deploy --all would refuse the pools {sorted(needed - created)}"


def test_the_readme_creates_the_pools_before_it_deploys_and_starts_a_worker_after():
    commands = [" ".join(words[:3]) for words in readme_commands()]
    deploy = commands.index("prefect deploy --all")
    assert all(i < deploy for i, c in enumerate(commands) if c == "prefect work-pool create")
    assert any(i > deploy for i, c in enumerate(commands) if c == "prefect worker start")


def test_the_readme_quotes_every_version_it_passes_to_the_deployment():
    runs = [words for words in readme_commands() if words[:3] == ["prefect", "deployment", "run"]]
    versions = [words[i + 1] for words in runs for i, w in enumerate(words) if w == "--param"
                and words[i + 1].startswith("version=")]
    assert versions and all(v.startswith('version="') and v.endswith('"') for v in versions), versions


def test_every_kiln_option_the_readme_uses_exists():
    from kiln.flows.cli import build_parser

    for words in readme_commands():
        if words[0] == "kiln":
            build_parser().parse_args(words[1:])  # argparse exits on an unknown option
