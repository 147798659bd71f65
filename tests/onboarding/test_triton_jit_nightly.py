"""Pure-Triton packages through the whole nightly, with nothing written by hand but what kiln init wrote:
the jitk fixture and a real public package (liger-kernel, fetched at test time as published); and a GPU-only
package's nightly on this machine, whose bench stage is 'not run' with the reason."""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.flows.cli import main
from tests.helpers.gitrepo import FIXTURES, commit_all, git_project, init_repo
from tests.helpers.indexcheck import check_local_index
from tests.helpers.real_packages import committed_checkout, fetch_sdist, load_pin
from tests.helpers.venvs import make_venv
from tests.helpers.venvs import run as run_in_venv


def _nightly(config: Path, out: Path) -> RunManifest:
    from kiln.flows.nightly import nightly_flow

    state = nightly_flow(config_path=str(config), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _published_wheels(index: Path) -> list[Path]:
    return sorted(index.rglob("*.whl"))


def _kiln_init(repo: Path) -> Path:
    assert main(["init", str(repo)]) == 0
    commit_all(repo, "kiln init")  # the nightly publishes only a clean commit
    return repo / "kiln.toml"


def _install_and_import(tmp_path: Path, simple: Path, distribution: str, version: str, module: str) -> dict:
    """pip install NAME==VERSION from the published index into a fresh venv (torch and triton: the machine's
    indexes, already satisfied through the venv's view of the test environment), then import it there."""
    python = make_venv(tmp_path / "venv")
    install = run_in_venv([str(python), "-m", "pip", "install", "--index-url", simple.as_uri(),
                           f"{distribution}=={version}"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", f"import json, {module} as m; print(json.dumps({{'file': m.__file__}}))"],
                        cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["file"].startswith(str(tmp_path / "venv")), found  # the published wheel's copy, not the checkout
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_pure_triton_package_builds_one_portable_wheel_published_once_and_tested_through_the_interpreter(
        prefect_server, tmp_path):
    repo = tmp_path / "jitk"
    shutil.copytree(FIXTURES / "jitk", repo, ignore=shutil.ignore_patterns("__pycache__"))
    init_repo(repo)
    run = _nightly(_kiln_init(repo), tmp_path / "out")
    units = {u.id: u for u in run.units}
    assert units["test/unit/any"].state == "completed" and units["test/unit/any"].message.startswith("1 passed")
    assert units["test/gpu/any"].state == "not_run"  # its GPU suite: a GPU pool's, not this machine's
    wheels = [run.root / a.path for a in run.artifacts_of("wheel")]
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    version = wheels[0].name.split("-")[1]
    assert "+" not in version and version.startswith("0.4.1.dev")  # no local label: nothing variant about it
    with zipfile.ZipFile(wheels[0]) as archive:
        assert not [n for n in archive.namelist() if n.endswith((".so", ".cubin", ".hsaco"))]
        metadata = archive.read(f"jit_kernels-{version}.dist-info/METADATA").decode()
    assert "Requires-Dist: torch" in metadata and "Requires-Dist: triton" in metadata  # the project's own
    index = tmp_path / "out" / "index"
    assert [w.name for w in _published_wheels(index)] == [wheels[0].name]  # published once, not per backend
    simple = index / "nightly" / "any" / "simple"
    assert check_local_index(simple).problems == []
    _install_and_import(tmp_path, simple, "jit-kernels", version, "jitk")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_gpu_only_package_nightly_here_ends_completed_with_its_bench_not_run_and_the_reason(
        prefect_server, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine benchmarks the cu130 wheel")

    def gpu_only(repo: Path) -> None:  # plaincuda without its cpu variant: nothing here runs its wheel
        text = (repo / "kiln.toml").read_text()
        (repo / "kiln.toml").write_text(text.replace('[[variants]]\nname = "cpu"\nbackend = "cpu"\n', "")
                                        .replace('archs = ["8.0", "9.0"]', 'archs = ["8.0"]'))

    run = _nightly(git_project("plaincuda", tmp_path, edit=gpu_only), tmp_path / "out")
    units = {u.id: u for u in run.units}
    bench = units["bench/-"]
    assert bench.state == "not_run"
    assert bench.message.startswith("not run: no variant of kiln.toml runs on this machine (cpu);"
                                    " its variants are cu130 (cuda)")
    assert [a.variant for a in run.artifacts_of("wheel")] == ["cu130"]  # built and published all the same


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_switched_off_bench_stage_is_not_run_and_builds_nothing(prefect_server, tmp_path):
    from kiln.flows.bench import bench_flow

    repo = tmp_path / "jitk"
    shutil.copytree(FIXTURES / "jitk", repo, ignore=shutil.ignore_patterns("__pycache__"))
    init_repo(repo)
    config = _kiln_init(repo)
    config.write_text(config.read_text() + "\n[bench]\nenabled = false\n")
    state = bench_flow(config_path=str(config), out=str(tmp_path / "out"), return_state=True)
    assert state.is_completed(), state.message
    run = RunManifest.load(tmp_path / "out" / str(state.state_details.flow_run_id))
    assert [(u.id, u.state) for u in run.units] == [("bench/-", "not_run")]  # no build, no measurement
    assert "switched off ([bench] enabled = false" in run.units[0].message


@pytest.mark.slow
@pytest.mark.real_package
@pytest.mark.timeout(2400)
def test_liger_kernel_as_published_goes_through_kiln_init_and_the_nightly_and_installs_from_its_index(
        prefect_server, tmp_path):
    """liger-kernel (pure Triton, setuptools + setuptools-scm, src layout), its sdist as published: kiln init,
    then a nightly with nothing else written by hand. Its tests put tensors on a CUDA device, so kiln init
    makes them a GPU suite: 'not run' here, and the portable wheel is published marked untested."""
    pin = load_pin("liger-kernel")
    repo = committed_checkout(fetch_sdist(pin, tmp_path / "sdist"))
    config = _kiln_init(repo)
    started = time.monotonic()
    run = _nightly(config, tmp_path / "out")
    print(f"liger-kernel {pin.version}: cold nightly in {time.monotonic() - started:.1f} s")
    units = {u.id: u for u in run.units}
    assert units["test/gpu/any"].state == "not_run"  # no GPU here: the wheel is published marked untested
    assert [u.state for uid, u in units.items() if uid.startswith("publish/any/")] == ["completed"]
    wheels = [run.root / a.path for a in run.artifacts_of("wheel")]
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    version = wheels[0].name.split("-")[1]
    assert version.startswith("0.8.6.dev") and "+" not in version  # above the 0.8.5 release, no local label
    with zipfile.ZipFile(wheels[0]) as archive:
        names = set(archive.namelist())
    source = repo / "src" / pin.import_name
    modules = {f"{pin.import_name}/{p.relative_to(source).as_posix()}" for p in source.rglob("*.py")}
    assert len(modules) > 100 and sorted(modules - names) == []  # every module of the package, as published
    simple = tmp_path / "out" / "index" / "nightly" / "any" / "simple"
    assert [w.name for w in _published_wheels(tmp_path / "out" / "index")] == [wheels[0].name]
    assert check_local_index(simple).problems == []
    _install_and_import(tmp_path, simple, "liger-kernel", version, pin.import_name)
