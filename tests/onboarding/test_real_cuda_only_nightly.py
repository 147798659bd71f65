"""causal-conv1d as published (a real CUDA-only extension package with flash-attention's prebuilt-wheel switch
and a setup.py that hard-codes nine -gencode archs) through kiln init and the nightly with zero edits.

kiln init gives it the cu130 variant only, CAUSAL_CONV1D_FORCE_BUILD=TRUE in its build_env and arch_policy
"narrow": its build compiles through Kiln's nvcc, which keeps the variant's one arch of its nine, so the wheel
holds exactly the SASS Kiln compiled for the arch it records. The published wheel installs from its index into
a fresh venv beside the CUDA torch (2.14.1), which imports it with its CUDA extension loaded.

Opt-in (KILN_TEST_HEAVY_BUILDS=1): nvcc takes about 20 minutes for its one arch on a 2-core machine, far past
what CI can give one test (benchmarks/RESULTS.md); the fixture test of the same path (tests/build/
test_nvcc_narrow.py) runs in CI."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.config import load_config
from tests.helpers.cuda_torch import link_shared_envs, shared_cuda_torch_env, shared_envs_root
from tests.helpers.indexcheck import check_local_index
from tests.helpers.real_packages import committed_checkout, download_sdist, load_pin
from tests.helpers.venvs import run as run_in_venv
from tests.onboarding.test_real_cuda_extension import _cuda_torch_venv
from tests.onboarding.test_triton_jit_nightly import _kiln_init, _nightly

pytestmark = [pytest.mark.slow, pytest.mark.real_package,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed"),
              pytest.mark.skipif(os.environ.get("KILN_TEST_HEAVY_BUILDS") != "1",
                                 reason="opt-in (KILN_TEST_HEAVY_BUILDS=1): nvcc needs ~20 min for causal-conv1d")]

_PROBE = ("import json, torch, causal_conv1d as m, causal_conv1d_cuda as ext;"
          " print(json.dumps({'package': m.__file__, 'extension': ext.__file__, 'torch': torch.__version__}))")


@pytest.mark.timeout(5400)
def test_causal_conv1d_as_published_goes_through_kiln_init_and_the_nightly_at_one_arch(prefect_server, tmp_path):
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    cuda_torch = shared_cuda_torch_env()
    pin = load_pin("causal-conv1d")
    repo = committed_checkout(download_sdist(pin, tmp_path / "sdist"))
    config = _kiln_init(repo)
    loaded = load_config(config)
    variant = loaded.variant("cu130")
    assert [v.name for v in loaded.variants] == ["cu130"]  # CUDA only: no cpu variant
    assert variant.build_env == {"CAUSAL_CONV1D_FORCE_BUILD": "TRUE"} and variant.arch_policy == "narrow"
    assert len(variant.archs) == 1
    link_shared_envs(repo, shared_envs_root())
    started = time.monotonic()
    run = _nightly(config, tmp_path / "out")
    print(f"causal-conv1d {pin.version}: cold nightly in {time.monotonic() - started:.1f} s")

    units = {u.id: u for u in run.units}
    build = next(u for uid, u in units.items() if uid.endswith("/causal-conv1d/pep517") or uid.endswith(
        "/causal_conv1d/pep517"))
    assert "Kiln's nvcc dropped its build's own targets" in build.message, build.message
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert list(wheels) == ["cu130"] and wheels["cu130"].name.startswith("causal_conv1d-1.7.1.dev")
    planned = {parse_cuda_arch(a).sm for a in variant.archs}
    device = {n: (c.sass, c.ptx) for n, c in wheel_contents(wheels["cu130"], find_cuobjdump()).items()}
    assert [(n.split(".")[0], archs) for n, archs in device.items()] == [("causal_conv1d_cuda", (planned, set()))]
    simple = tmp_path / "out" / "index" / "nightly" / "cu130" / "simple"
    assert check_local_index(simple).problems == []
    python = _cuda_torch_venv(tmp_path / "venv", cuda_torch.python)
    version = wheels["cu130"].name.split("-")[1]
    install = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--index-url", simple.as_uri(),
                           f"causal-conv1d=={version}"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", _PROBE], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert all(found[k].startswith(str(tmp_path / "venv")) for k in ("package", "extension")), found
    assert found["torch"] == "2.14.1+cu130", found
