"""A CUDA-only torch extension with flash-attention's prebuilt-wheel switch goes through kiln init and the
nightly with zero edits (the cudaonly fixture: setup.py only, its distribution, extension module and import
package each named otherwise; its bdist_wheel downloads a prebuilt wheel unless CUDA_ONLY_OPS_FORCE_BUILD=TRUE).

kiln init gives it the cu130 variant only, with the switch in its build_env; the build reaches no download host,
so without the switch it could not have built at all. nvcc compiles its one kernel for the variant's arch;
the published wheel is installed from its index into a fresh venv beside the CUDA torch, which imports it."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.config import load_config
from tests.helpers.cuda_torch import link_shared_envs, shared_cuda_torch_env, shared_envs_root
from tests.helpers.gitrepo import FIXTURES
from tests.helpers.indexcheck import check_local_index
from tests.helpers.real_packages import committed_checkout
from tests.helpers.venvs import run as run_in_venv
from tests.onboarding.test_real_cuda_extension import _cuda_torch_venv
from tests.onboarding.test_triton_jit_nightly import _kiln_init, _nightly

_PROBE = ("import json, torch, coops, cuda_only_ops_C as ext;"
          " print(json.dumps({'package': coops.__file__, 'extension': ext.__file__}))")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_cuda_only_package_with_a_prebuilt_wheel_switch_goes_through_kiln_init_and_the_nightly(
        prefect_server, tmp_path):
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    cuda_torch = shared_cuda_torch_env()
    repo = tmp_path / "cudaonly"
    shutil.copytree(FIXTURES / "cudaonly", repo, ignore=shutil.ignore_patterns("__pycache__"))
    config = _kiln_init(committed_checkout(repo))
    variant = load_config(config).variant("cu130")
    assert [v.name for v in load_config(config).variants] == ["cu130"]  # no CPU build: no cpu variant
    assert variant.build_env == {"CUDA_ONLY_OPS_FORCE_BUILD": "TRUE"}
    link_shared_envs(repo, shared_envs_root())
    run = _nightly(config, tmp_path / "out")

    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert list(wheels) == ["cu130"] and wheels["cu130"].name.startswith("cuda_only_ops-0.3.1.dev")
    planned = {parse_cuda_arch(a).sm for a in variant.archs}
    device = {n: c.sass for n, c in wheel_contents(wheels["cu130"], find_cuobjdump()).items()}
    assert [(n.split(".")[0], sass) for n, sass in device.items()] == [("cuda_only_ops_C", planned)]  # built here
    simple = tmp_path / "out" / "index" / "nightly" / "cu130" / "simple"
    assert check_local_index(simple).problems == []
    python = _cuda_torch_venv(tmp_path / "venv", cuda_torch.python)
    version = wheels["cu130"].name.split("-")[1]
    install = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--index-url", simple.as_uri(),
                           f"cuda_only_ops=={version}"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", _PROBE], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert all(path.startswith(str(tmp_path / "venv")) for path in found.values()), found  # the published copy
