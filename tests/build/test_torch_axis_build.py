"""A non-stable torch extension over a torch axis, built for real (issue 45, part 1): exactop, an op on torch's
ordinary C++ API (TORCH_LIBRARY, at::Tensor), with ``torch = ["2.13.0", "2.14.1"]``. The build stage writes one
wheel per torch, their names distinct (the local label carries the torch), each pinning the series it was built
against (part 2: ``torch==2.13.*``, ``torch==2.14.*``), each installed and its op run beside its own torch; the
2.13 wheel beside torch 2.14.1 is refused by pip's resolver.

The 2.14.1 cell builds in the CUDA-torch environment the torch-extension tests share (no new install); the 2.13.0
cell's environment is made by the build from the machine's local CPU wheel of torch 2.13.0 (find-links) in the
same shared directory, so only the first run on a machine pays for it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from kiln.core.manifest import RunManifest
from kiln.core.venvs import make_build_env
from kiln.tasks.build.buildenv import overlay_env
from tests.helpers.cuda_torch import link_shared_envs, shared_cuda_torch_env, shared_envs_root
from tests.helpers.gitrepo import git_project

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")]

_RUN_OP = ("import json, torch, exactop; x = torch.arange(4, dtype=torch.float32);"
           " print('EXACTOP ' + json.dumps([torch.__version__, exactop.scale(x, 2.0).tolist()]))")


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args], capture_output=True,
                          text=True, timeout=300)


def _wheel_info(wheel: Path) -> tuple[list[str], dict[str, Any]]:
    """The wheel's torch requirements and its build record."""
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = BytesParser().parsebytes(archive.read(info)).get_all("Requires-Dist") or []
        record = json.loads(archive.read(info.replace("METADATA", "kiln_build.json")))
    return [r for r in requires if Requirement(r).name == "torch"], record


def _run_op(python: Path, wheel: Path) -> list[object]:
    """Install ``wheel`` (its torch is already there) into ``python``'s environment and run its op there."""
    done = _pip(python, "install", "--quiet", "--no-deps", "--no-index", str(wheel))
    assert done.returncode == 0, done.stderr[-3000:]
    ran = subprocess.run([str(python), "-P", "-c", _RUN_OP], capture_output=True, text=True, timeout=300,
                         cwd=python.parent)
    assert ran.returncode == 0, ran.stderr[-3000:]
    line = next(ln for ln in ran.stdout.splitlines() if ln.startswith("EXACTOP "))
    return list(json.loads(line.removeprefix("EXACTOP ")))


@pytest.mark.timeout(3600)
def test_a_non_stable_extension_over_a_torch_axis_writes_one_wheel_per_torch_each_pinning_and_loading_its_own(
        prefect_server, tmp_path):
    from kiln.flows.build import build_flow

    made = shared_cuda_torch_env()  # the torch-extension tests' torch 2.14.1: found, or made once per machine
    config = git_project("exactop", tmp_path)
    link_shared_envs(config.parent, shared_envs_root())
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="0.1.0.dev20261206", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    assert state.is_completed(), {u.id: (u.state, u.message) for u in run.units if u.state != "completed"}
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert set(wheels) == {"cputorch2130", "cputorch2141"}, wheels
    old, new = wheels["cputorch2130"], wheels["cputorch2141"]

    # two names, the torch in each local label; each a CPython 3.11 wheel (the library is not stable-ABI)
    assert old.name != new.name
    assert old.name.startswith("exactop-0.1.0.dev20261206+cputorch2.13-cp311-cp311-"), old.name
    assert new.name.startswith("exactop-0.1.0.dev20261206+cputorch2.14-cp311-cp311-"), new.name
    for wheel, series, built in ((old, "2.13", "2.13.0"), (new, "2.14", "2.14.1")):
        pins, record = _wheel_info(wheel)
        assert pins == [f"torch=={series}.*"], (wheel.name, pins)  # its own series, nothing looser
        assert record["toolchain"]["torch"] == built, record

    under_2_13 = _run_op(make_build_env(tmp_path / "torch213"), old)  # Kiln's own CPU torch 2.13.0
    under_2_14 = _run_op(overlay_env(tmp_path / "torch214", made), new)  # the shared torch 2.14.1 (CUDA 13 build)
    assert under_2_13 == ["2.13.0+cpu", [0.0, 2.0, 4.0, 6.0]], under_2_13
    assert under_2_14 == ["2.14.1+cu130", [0.0, 2.0, 4.0, 6.0]], under_2_14

    # The pin is real: beside torch 2.14.1 pip's resolver refuses the 2.13 wheel, and takes the 2.14 one.
    beside = overlay_env(tmp_path / "beside214", made)
    refused = _pip(beside, "install", "--dry-run", "--no-index", str(old), "torch==2.14.1")
    assert refused.returncode != 0, refused.stdout[-3000:]
    assert "conflicting dependencies" in refused.stderr + refused.stdout, refused.stderr[-3000:]
    assert "torch==2.13.*" in refused.stderr + refused.stdout, refused.stderr[-3000:]
    taken = _pip(beside, "install", "--dry-run", "--no-index", str(new), "torch==2.14.1")
    assert taken.returncode == 0, taken.stderr[-3000:]
