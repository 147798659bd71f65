"""ember, a torch CUDA extension as a team has it (no fallback in its setup.py), built with the CUDA build of
torch its cu130 variant's build_requires names, and its cpu variant with Kiln's CPU torch.

The CUDA torch environment (about 5.5 GB, minutes to make) is made once per machine: under a stable temporary
directory shared by every session, linked into each test project's build cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from tests.helpers.cuda_torch import CUDA_TORCH, link_shared_envs, shared_cuda_torch_envs
from tests.helpers.gitrepo import git_project

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")]


@pytest.fixture(scope="session")
def cuda_torch_envs() -> Path:
    """The directory holding the CUDA-torch build environment, made once (cold) or found (warm)."""
    return shared_cuda_torch_envs()


def _needed(library: bytes, tmp_path: Path) -> set[str]:
    path = tmp_path / "lib.so"
    path.write_bytes(library)
    dump = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, timeout=60, check=True)
    return {line.split("[", 1)[1].split("]", 1)[0] for line in dump.stdout.splitlines() if "(NEEDED)" in line}


def _wheel(path: Path) -> tuple[dict[str, bytes], str]:
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    dist_info = next(n.split("/")[0] for n in members if n.endswith(".dist-info/METADATA"))
    return members, dist_info


@pytest.mark.timeout(3600)
def test_ember_cu130_builds_against_the_cuda_torch_with_exactly_the_planned_sass(prefect_server, cuda_torch_envs,
                                                                                 tmp_path):
    from kiln.flows.build import build_flow
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    config = git_project("ember", tmp_path)
    link_shared_envs(config.parent, cuda_torch_envs)
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="0.2.0.dev20261203", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert state.is_completed(), {u.id: u.message for u in run.units if u.state != "completed"}
    assert "holds SASS ['sm_80']" in units["build/cu130/sm_80/ember-ops/pep517"].message  # recorded in the run
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}

    contents = wheel_contents(wheels["cu130"], find_cuobjdump())
    assert [(c.sass, c.ptx) for c in contents.values()] == [({"sm_80"}, frozenset())]  # exactly the plan
    members, dist_info = _wheel(wheels["cu130"])
    library = members[next(iter(contents))]
    # CUDAExtension of the CUDA torch (a CPU torch has no CUDA_HOME and no CUDA libraries: ember has no fallback
    # any more); the linker keeps the CUDA 13 runtime its kernel launch calls, beside torch's own libraries.
    needed = _needed(library, tmp_path)
    assert {"libcudart.so.13", "libc10.so", "libtorch_cpu.so"} <= needed, needed
    requires = BytesParser().parsebytes(members[f"{dist_info}/METADATA"]).get_all("Requires-Dist")
    # the release series it was built against: torch keeps its C++ ABI across 2.14's patch releases only
    assert "torch==2.14.*" in requires and not [r for r in requires if r.startswith("torch") and r != "torch==2.14.*"]
    assert json.loads(members[f"{dist_info}/kiln_build.json"])["toolchain"]["torch"] == "2.14.1"

    cpu_members, cpu_info = _wheel(wheels["cpu"])
    cpu_library = next(data for name, data in cpu_members.items() if name.endswith(".so"))
    assert "libtorch_cuda.so" not in _needed(cpu_library, tmp_path)  # Kiln's CPU torch
    cpu_requires = BytesParser().parsebytes(cpu_members[f"{cpu_info}/METADATA"]).get_all("Requires-Dist")
    assert "torch==2.13.*" in cpu_requires


_TORCH_14_ONLY = b"""// Compiles only against torch 2.14: Kiln's own torch (2.13) would fail the static_assert.
#include <torch/version.h>
static_assert(TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 14, "built against another torch");
__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }
"""


@pytest.mark.timeout(1800)
def test_an_nvcc_torch_unit_of_a_variant_with_build_requires_compiles_against_that_environments_torch(
        cuda_torch_envs, tmp_path):
    """Kiln's own nvcc units (a registry's csrc with [build.toolchain] torch = true): torch's include and
    library dirs come from the variant's build environment, read with its python."""
    from kiln.tasks.build.buildenv import VariantEnvironments
    from kiln.tasks.build.nvcc import NvccBuilder, find_nvcc
    from kiln.tasks.build.plan import CompileUnit
    from kiln.tasks.build.units import CompileContext, _compile
    from kiln.tasks.project.config import load_config
    from kiln.tasks.project.registry_types import CudaSourceRecord
    from kiln.tasks.wheel.devicecode import embedded_archs
    from tests.helpers.projects import copy_project

    config_path = copy_project("tiny", tmp_path)
    config_path.write_text(config_path.read_text().replace('archs = ["8.0", "9.0"]', 'archs = ["8.0", "9.0"]\n'
                                                           f'build_requires = ["{CUDA_TORCH}"]')
                           + "\n[build.toolchain]\ntorch = true\n")
    config = load_config(config_path)
    package = config.path(config.project.source)
    (package / "twice.cu").write_bytes(_TORCH_14_ONLY)
    nvcc = find_nvcc()
    record = CudaSourceRecord("twice", ("twice.cu",), ("8.0",), "libtwice.so")
    builder = NvccBuilder(nvcc, package, {"twice": record})
    envs = VariantEnvironments(cuda_torch_envs, {v.name: (v.backend, v.build_requires) for v in config.variants}, 3600)
    env = CompileContext(str(config_path), tmp_path / "out", None, None, 600, {}, nvcc=builder,  # type: ignore[arg-type]
                   environments=envs, config=config)
    unit = CompileUnit("build/cu130/sm_80/twice/twice", "cu130", "cuda", "8.0", "8.0", "twice", "libtwice.so",
                       "twice", "nvcc", "b", "k", ("8.0",))
    files, _seconds = _compile(unit, env)
    library = tmp_path / "libtwice.so"
    library.write_bytes(files["libtwice.so"])
    assert embedded_archs(library, nvcc.cuobjdump)[0] == {"sm_80"}
    assert envs.torch("cu130").cuda == "13.0"
