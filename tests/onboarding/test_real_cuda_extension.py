"""A real public torch C++/CUDA extension (torchsort, fetched at test time as published) through the whole
nightly, with nothing written by hand but what kiln init wrote: its cu130 wheel with exactly the planned SASS,
its cpu wheel with no CUDA at all, both published and installed from their indexes into fresh venvs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest

from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.config import load_config
from tests.helpers.cuda_torch import CUDA_TORCH, link_shared_envs, shared_cuda_torch_env, shared_envs_root
from tests.helpers.indexcheck import check_local_index
from tests.helpers.real_packages import committed_checkout, fetch_sdist, load_pin
from tests.helpers.venvs import make_venv
from tests.helpers.venvs import run as run_in_venv
from tests.onboarding.test_triton_jit_nightly import _kiln_init, _nightly

pytestmark = [pytest.mark.slow, pytest.mark.real_package,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")]

# Imports the package, ranks on the CPU through its C++ op, and says whether its CUDA library loaded.
_PROBE = ("import json, sys, torch, torchsort as m;"
          " r = m.soft_rank(torch.tensor([[3.0, 1.0, 2.0]]), regularization_strength=1e-3).round().tolist();"
          " print(json.dumps({'file': m.__file__, 'torch': torch.__version__, 'ranks': r,"
          " 'cuda_op': 'torchsort.isotonic_cuda' in sys.modules}))")


def _wheel_metadata(wheel: Path) -> tuple[set[str], list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = BytesParser().parsebytes(archive.read(metadata)).get_all("Requires-Dist") or []
    return names, requires


def _install_and_probe(python: Path, simple: Path, spec: str, cwd: Path) -> dict:
    install = run_in_venv([str(python), "-m", "pip", "install", "--index-url", simple.as_uri(), spec], cwd=cwd)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", _PROBE], cwd=cwd)
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _cuda_torch_venv(path: Path, cuda_python: Path) -> Path:
    """A fresh venv that sees the shared CUDA-torch environment's packages (its torch 2.14.1), not the test's."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    paths = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    ours, theirs = (subprocess.run([str(p), "-c", paths], check=True, capture_output=True, text=True,
                                   timeout=300).stdout.strip() for p in (python, cuda_python))
    Path(ours, "zz_cuda_torch_site.pth").write_text(theirs + "\n")
    return python


@pytest.mark.timeout(3600)
def test_torchsort_as_published_goes_through_kiln_init_and_the_nightly_and_installs_from_its_indexes(
        prefect_server, tmp_path):
    """torchsort (setup.py: a CppExtension always, a CUDAExtension wherever nvcc is found), its sdist as
    published: kiln init, the shared CUDA-torch build environment linked, then the nightly. kiln init gives its
    cu130 variant one arch and the CUDA torch as build_requires; its cpu variant builds with Kiln's CPU torch and
    sees no CUDA toolkit, so its setup.py leaves the CUDA extension out. Its tests import fast_soft_sort (a git
    dependency) and use CUDA devices: a GPU suite, not run here, so both wheels are published untested.
    The cu130 wheel is installed into a fresh venv that sees the CUDA-torch environment (torch 2.14.1, its pin;
    the CUDA libraries load without a GPU) and imports with its CUDA op loaded; the cpu wheel into a fresh venv
    that sees the test's CPU torch (2.13.0, its pin). Both sort on the CPU."""
    cuda_torch = shared_cuda_torch_env()
    pin = load_pin("torchsort")
    # pip reads the sdist's metadata by running its setup.py: with nvcc here, that needs a CUDA torch.
    repo = committed_checkout(fetch_sdist(pin, tmp_path / "sdist", python=cuda_torch.python))
    config = _kiln_init(repo)
    link_shared_envs(repo, shared_envs_root())
    started = time.monotonic()
    run = _nightly(config, tmp_path / "out")
    print(f"torchsort {pin.version}: cold nightly in {time.monotonic() - started:.1f} s")

    variant = load_config(config).variant("cu130")
    assert len(variant.archs) == 1 and variant.build_requires == (CUDA_TORCH,)  # as kiln init wrote them
    planned = {parse_cuda_arch(a).sm for a in variant.archs}
    units = {u.id: u for u in run.units}
    assert units["test/gpu/cu130"].state == "not_run"
    assert sorted(uid.split("/")[1] for uid, u in units.items()
                  if uid.startswith("publish/") and uid != "publish/pages" and u.state == "completed"
                  and not uid.startswith(("publish/wheel-variants/", "publish/dependencies/"))) == ["cpu", "cu130"]
    # each variant's wheel resolves with its dependencies (the CUDA torch for cu130) from PyPI before it is published
    assert [units[f"publish/dependencies/{v}"].state for v in ("cpu", "cu130")] == ["completed", "completed"]
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert set(wheels) == {"cu130", "cpu"}

    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    cuobjdump = find_cuobjdump()
    contents = {name: (c.sass, c.ptx) for name, c in wheel_contents(wheels["cu130"], cuobjdump).items()}
    device = {name: archs for name, archs in contents.items() if archs != (frozenset(), frozenset())}
    assert [(n.split("/")[-1].split(".")[0], a) for n, a in device.items()] == [("isotonic_cuda", (planned, set()))]
    names, requires = _wheel_metadata(wheels["cu130"])
    assert "torch==2.14.*" in requires, requires  # the release series of the torch it built against (CUDA_TORCH)
    cpu_names, cpu_requires = _wheel_metadata(wheels["cpu"])
    libraries = sorted(n for n in names if n.endswith(".so"))
    assert [n.split("/")[-1].split(".")[0] for n in libraries] == ["isotonic_cpu", "isotonic_cuda"]
    assert sorted(n for n in cpu_names if n.endswith(".so")) == libraries[:1]  # its CPU op, no CUDA one
    assert all(archs == (frozenset(), frozenset()) for archs in
               ((c.sass, c.ptx) for c in wheel_contents(wheels["cpu"], cuobjdump).values()))
    assert "torch==2.13.*" in cpu_requires, cpu_requires  # Kiln's own (CPU) torch's series

    index = tmp_path / "out" / "index" / "nightly"
    for variant_name in ("cu130", "cpu"):
        assert check_local_index(index / variant_name / "simple").problems == []
    version = wheels["cu130"].name.split("-")[1].split("+")[0]
    assert version.startswith("0.1.11.dev")  # above the 0.1.10 release

    cuda = _install_and_probe(_cuda_torch_venv(tmp_path / "venv-cu130", cuda_torch.python), index / "cu130" / "simple",
                              f"torchsort=={version}+cu130", tmp_path)
    assert cuda["file"].startswith(str(tmp_path / "venv-cu130")), cuda  # the published wheel's copy
    assert cuda["torch"] == "2.14.1+cu130" and cuda["cuda_op"] and cuda["ranks"] == [[3.0, 1.0, 2.0]], cuda
    cpu = _install_and_probe(make_venv(tmp_path / "venv-cpu"), index / "cpu" / "simple", f"torchsort=={version}+cpu",
                             tmp_path)
    assert cpu["file"].startswith(str(tmp_path / "venv-cpu")), cpu
    assert cpu["torch"].startswith("2.13.0") and not cpu["cuda_op"] and cpu["ranks"] == [[3.0, 1.0, 2.0]], cpu
