"""The stable-ABI mode, built for real (issue 45, part 2): stableop, an op registered through the LibTorch stable
ABI (STABLE_TORCH_LIBRARY), built once by its own setuptools build against torch 2.14.1 (the CUDA build the
torch-extension tests share: no new install) with torch_target = "2.13", installed beside torch 2.13.0 (Kiln's
CPU torch) and beside torch 2.14.1, and its op run under each; the same package with one unstable ATen call
planted fails its unit naming the symbol, while the clean variant's wheel is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kiln.core.manifest import RunManifest
from kiln.tasks.build.buildenv import overlay_env
from kiln.tasks.testing.envs import make_build_env
from tests.helpers.cuda_torch import link_shared_envs, shared_cuda_torch_env, shared_envs_root
from tests.helpers.gitrepo import git_project

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")]

_RUN_OP = ("import json, torch, stableop; x = torch.arange(4, dtype=torch.float32);"
           " print('STABLEOP ' + json.dumps([torch.__version__, stableop.scale(x, 2.0).tolist()]))")


def _metadata(wheel: Path) -> tuple[list[str], str]:
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        wheel_file = archive.read(info.replace("METADATA", "WHEEL")).decode()
        return BytesParser().parsebytes(archive.read(info)).get_all("Requires-Dist") or [], wheel_file


def _run_op(python: Path, wheel: Path) -> list[object]:
    """Install ``wheel`` (its torch is already there) into ``python``'s environment and run its op there."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300, capture_output=True, text=True)
    done = subprocess.run([str(python), "-P", "-c", _RUN_OP], capture_output=True, text=True, timeout=300,
                          cwd=python.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("STABLEOP "))
    return list(json.loads(line.removeprefix("STABLEOP ")))


@pytest.mark.timeout(3600)
def test_one_stable_abi_wheel_loads_under_torch_2_13_and_2_14_and_a_planted_unstable_symbol_fails_its_unit(
        prefect_server, tmp_path):
    from kiln.flows.build import build_flow

    made = shared_cuda_torch_env()  # the torch-extension tests' torch 2.14.1: found, or made once per machine
    config = git_project("stableop", tmp_path)
    link_shared_envs(config.parent, shared_envs_root())
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="0.1.0.dev20261206", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}

    planted = units["build/planted/wheel"]  # one failure stays one failure: the clean variant's wheel is written
    assert state.is_failed() and planted.state == "failed", {u.id: (u.state, u.message) for u in run.units}
    assert 'claims the torch stable ABI (abi = "stable") but uses unstable torch symbols' in planted.message
    assert "at::get_num_threads()" in planted.message, planted.message
    assert units["build/cpu/wheel"].state == "completed", units["build/cpu/wheel"].message
    (wheel,) = (run.root / a.path for a in run.artifacts_of("wheel") if a.variant == "cpu")

    # one wheel for every Python 3: the library uses no Python C-API (the package asked for cp310-abi3)
    assert wheel.name.startswith("stableop-0.1.0.dev20261206+cpu-py3-none-manylinux_"), wheel.name
    requires, wheel_file = _metadata(wheel)
    assert "Tag: py3-none-manylinux_" in wheel_file and "abi3" not in wheel_file, wheel_file
    torch_lines = [r for r in requires if Requirement(r).name == "torch"]
    assert torch_lines == ["torch>=2.13"], requires  # its target (torch-abi-audit's floor is 2.13.0 too)

    under_2_13 = _run_op(make_build_env(tmp_path / "torch213"), wheel)  # Kiln's own CPU torch 2.13.0
    under_2_14 = _run_op(overlay_env(tmp_path / "torch214", made), wheel)  # the torch it was built against
    assert under_2_13[0] == "2.13.0+cpu" and under_2_14[0] == "2.14.1+cu130", (under_2_13, under_2_14)
    assert under_2_13[1] == under_2_14[1] == [0.0, 2.0, 4.0, 6.0]

    # The test stage runs its suite under each torch the wheel claims (its torch axis; issue 45, part 3): 2.13.0 on
    # the shared base copied from Kiln's interpreter, 2.14.1 on the build's torch-2.14.1 environment (the one the
    # build found: nothing new is installed). The coverage table has one row per (cell, torch).
    from kiln.flows.test import test_flow
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.coverage import coverage_rows

    test_flow(str(config), str(out), suites=["unit"], run_id=run.run_id, return_state=True)
    run = RunManifest.load(out / run.run_id)
    tests = {u.id: u for u in run.units if u.stage == "test"}
    assert set(tests) == {"test/unit/cpu/torch2.13.0", "test/unit/cpu/torch2.14.1", "test/unit/planted/torch2.13.0"}
    for torch, version in (("2.13.0", "2.13.0+cpu"), ("2.14.1", "2.14.1+cu130")):
        assert tests[f"test/unit/cpu/torch{torch}"].state == "completed", tests
        assert tests[f"test/unit/cpu/torch{torch}"].message.startswith("1 passed"), tests
        (python,) = out.glob(f"**/tests/.envs/unit.cpu.torch{torch}/bin/python")
        probe = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                               text=True, timeout=300, check=True)
        assert probe.stdout.strip() == version, probe
    rows = [r for r in coverage_rows(load_config(str(config)), run) if r.variant == "cpu"]
    assert [(r.torch, r.state) for r in rows] == [("2.13.0 (>=2.13)", "tested"), ("2.14.1 (>=2.13)", "tested")], rows
