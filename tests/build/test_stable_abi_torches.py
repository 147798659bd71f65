"""A stable-ABI wheel's suites run once per torch it claims (issue 45, part 3): which torches, the unit of each,
and a torch that cannot be had is "not run" naming why (the real runs under 2.13.0 and 2.14.1 are in
tests/build/test_stable_abi_build.py).
"""

from __future__ import annotations

import shutil
from importlib import metadata
from pathlib import Path

from packaging.version import Version

from kiln.tasks.project.config import load_config
from kiln.tasks.project.config_matrix import claimed_torches
from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.suite import SuiteTarget, run_suite, targets

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "projects" / "stableop"
HOST = Version(metadata.version("torch")).public  # Kiln's CPU torch, 2.13.0


def _project(tmp_path: Path, edit: tuple[str, str] | None = None) -> Path:
    repo = tmp_path / "stableop"
    shutil.copytree(FIXTURE, repo, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    if edit is not None:
        text = (repo / "kiln.toml").read_text()
        assert edit[0] in text
        (repo / "kiln.toml").write_text(text.replace(*edit))
    return repo / "kiln.toml"


def test_a_stable_variant_claims_its_torch_axis_or_its_build_and_target_torches_and_others_claim_none(tmp_path):
    config = load_config(str(_project(tmp_path)))
    assert claimed_torches(config.variant("cpu")) == ("2.13.0", "2.14.1")  # its axis, built once against 2.14.1
    assert claimed_torches(config.variant("planted")) == (HOST,)  # no axis, no target: the torch it builds with
    assert [t.unit_id for t in targets(config, config.suites)] == [
        "test/unit/cpu/torch2.13.0", "test/unit/cpu/torch2.14.1", f"test/unit/planted/torch{HOST}"]

    axisless = load_config(str(_project(tmp_path / "b", ('torch = ["2.13.0", "2.14.1"]',
                                                          'build_requires = ["torch==2.14.1"]'))))
    assert claimed_torches(axisless.variant("cpu")) == ("2.13.0", "2.14.1")  # its build torch and its target's

    floor = load_config(str(_project(tmp_path / "c", ('torch_target = "2.13"', 'torch_target = "2.14"'))))
    assert claimed_torches(floor.variant("cpu")) == ("2.14.1",)  # a torch below its floor is not claimed

    exact = load_config(str(_project(tmp_path / "d", ('abi = "stable"\ntorch_target = "2.13"\n', ''))))
    assert claimed_torches(exact.variant("cputorch2141")) == ()  # not stable: one run per cell, as before
    assert [t.unit_id for t in targets(exact, exact.suites) if not t.torch] == [  # one cell per torch, as before
        "test/unit/cputorch2130", "test/unit/cputorch2141"]


def test_a_claimed_torch_that_cannot_be_had_is_not_run_naming_it(tmp_path):
    config = load_config(str(_project(tmp_path)))
    target = SuiteTarget(config.suites[0], config.variant("cpu"), "2.99.0")  # on no source this machine has
    suite_run = run_suite(config, target, [], tmp_path / "view", RunOptions())
    assert suite_run.unit.id == "test/unit/cpu/torch2.99.0"
    assert suite_run.unit.state == "not_run", suite_run.unit
    assert suite_run.unit.message.startswith("not run: torch 2.99.0 is not available here ("), suite_run.unit.message
