"""A failed pep517 build unit names the setting its package's own build files say it lacks, instead of ending in a
log tail: the first nightly's failure says what to change in kiln.toml."""

from __future__ import annotations

import re
import shutil

import pytest

from kiln.core.manifest import RunManifest
from kiln.flows.cli import main
from tests.helpers.gitrepo import FIXTURES


@pytest.mark.slow
def test_a_cpu_build_stopped_by_its_cuda_switch_says_which_build_env_to_add(prefect_server, tmp_path):
    from kiln.flows.build import build_flow

    repo = tmp_path / "cpuswitch"
    shutil.copytree(FIXTURES / "cpuswitch", repo, ignore=shutil.ignore_patterns("__pycache__", "kiln.toml"))
    assert main(["init", str(repo)]) == 0
    config = repo / "kiln.toml"
    text = config.read_text()
    # the kiln.toml of before: its CPU variant without the switch that opens the CPU path (and no GPU variant here)
    text = re.sub(r'build_env = \{ SWOPS_CUDA_EXT = "0" \}[^\n]*\n', "", text)
    assert 'SWOPS_CUDA_EXT = "0"' not in text, text
    config.write_text(text)
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.1.dev20261206", variants=["cpu"], return_state=True)
    assert state.is_failed()
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    [unit] = [u for u in run.units if u.id.endswith("/pep517")]
    assert unit.state == "failed"
    assert 'add SWOPS_CUDA_EXT = "0" to [[variants]] cpu build_env' in unit.message, unit.message
