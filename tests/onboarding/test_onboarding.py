"""Onboarding: the onboarding guide's smallest kiln.toml is valid, and a third-party package goes through as it is."""

from __future__ import annotations

import json
import platform
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.wheels import import_names
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import git_project, vendor_acme_library
from tests.helpers.indexcheck import check_local_index
from tests.helpers.venvs import make_venv
from tests.helpers.venvs import run as run_in_venv

REPO = Path(__file__).resolve().parents[2]


def _readme_toml(which: int = 0) -> str:
    """The onboarding guide's (docs/guides/onboarding.md) kiln.toml blocks: the Triton-only package (0), a self-building one (1)."""
    section = (REPO / "docs" / "guides" / "onboarding.md").read_text().split("## Onboarding your kernel package", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    return blocks[which]


def test_the_readme_onboarding_config_loads_in_a_src_layout_project(tmp_path):
    (tmp_path / "kiln.toml").write_text(_readme_toml())
    (tmp_path / "src" / "mykernels").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    config = load_config(tmp_path / "kiln.toml")
    assert config.project.package == "mykernels" and config.project.distribution == "my-kernels"
    assert [v.name for v in config.variants] == ["cu130", "cpu"]
    assert config.variant("cu130").archs == ("9.0", "10.0")
    assert [s.name for s in config.suites] == ["unit"]
    assert config.path(config.project.source) == tmp_path / "src" / "mykernels"


def test_the_readme_config_of_a_package_with_its_own_build_backend_loads(tmp_path):
    (tmp_path / "kiln.toml").write_text(_readme_toml(1))
    (tmp_path / "src" / "myops").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("[build-system]\nrequires = [\"setuptools\"]\n")
    config = load_config(tmp_path / "kiln.toml")
    assert config.build.backend == "pep517" and config.project.registry is None
    assert config.path(config.build.project_dir) == tmp_path and config.build.toolchain.torch
    assert [v.name for v in config.variants] == ["cu130", "cpu"] and config.variant("cu130").archs == ("8.0", "9.0")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_third_party_src_layout_package_goes_through_the_nightly_and_installs_from_its_index(
        prefect_server, tmp_path):
    """acme-ops (import name acme): src layout, public spec types, the shipped loader, a vendored .so."""
    from kiln.flows.nightly import nightly_flow

    config = git_project("acme", tmp_path, edit=vendor_acme_library)
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert units["test/unit/cpu"].state == "completed" and units["test/unit/cpu"].message.startswith("2 passed")
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert set(wheels) == {"cu130", "cpu"}
    for variant, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
        assert "acme/vendor/libacme_checksum.so" in names, variant  # package data the project ships is kept
        assert import_names(wheel.name, wheel.read_bytes()) == ("acme",)  # read from the wheel, not guessed
        # the vendored library links glibc alone: auditwheel's analysis allows a manylinux tag
        assert "-py3-none-manylinux_2_" in wheel.name and wheel.name.endswith(f"_{platform.machine()}.whl"), wheel.name
    with zipfile.ZipFile(wheels["cu130"]) as archive:
        manifest = json.loads(archive.read("acme/_aot/manifest.json"))
    assert {(e["kernel"], e["arch"]) for e in manifest} == {("axpy", "9.0")}  # its archs, filtered by the plan
    simple = out / "index" / "nightly" / "cpu" / "simple"
    assert check_local_index(simple).problems == []
    python = make_venv(tmp_path / "venv")
    # --ignore-installed: the venv sees the test environment's editable kiln-runtime, which pip would keep
    install = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--index-url",
                           simple.as_uri(), "acme-ops", "kiln-runtime"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", _PROBE], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["file"].startswith(str(tmp_path / "venv")) and found["checksum"] == 3292000 and found["ok"]


_PROBE = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"  # no GPU here: the installed kernel runs in Triton's interpreter
import torch, acme
x = torch.arange(10, dtype=torch.float32)
ok = bool(torch.equal(acme.axpy(3.0, x, torch.ones(10)), 3.0 * x + 1))
print(json.dumps({"file": acme.__file__, "checksum": acme.checksum(b"kiln"), "ok": ok}))
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_torch_cpp_extension_package_built_by_its_own_backend_goes_through_the_nightly(prefect_server, tmp_path):
    """ember-ops (import name ember): setuptools + torch cpp_extension, a CUDA op registered with TORCH_LIBRARY,
    no Kiln registry; nvcc compiles it for the variant's archs only, and the wheel keeps the project's metadata."""
    from email.parser import BytesParser

    from kiln.flows.nightly import nightly_flow
    from kiln.tasks.build.buildenv import ensure_env
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents
    from tests.helpers.cuda_torch import CUDA_TORCH, link_shared_envs, shared_cuda_torch_envs

    config = git_project("ember", tmp_path)
    envs = shared_cuda_torch_envs()  # cu130 builds against the CUDA torch (build_requires), made once per machine
    link_shared_envs(config.parent, envs)
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert units["build/cu130/sm_80/ember-ops/pep517"].state == "completed"
    assert units["test/unit/cpu"].state == "completed" and units["test/unit/cpu"].message.startswith("2 passed")
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert set(wheels) == {"cu130", "cpu"}
    devices = {v: {n: c.sass for n, c in wheel_contents(w, find_cuobjdump()).items()} for v, w in wheels.items()}
    assert list(devices["cu130"].values()) == [frozenset({"sm_80"})]  # the filtered archs, nothing else
    assert list(devices["cpu"].values()) == [frozenset()]
    with zipfile.ZipFile(wheels["cu130"]) as archive:
        dist_info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = BytesParser().parsebytes(archive.read(f"{dist_info}/METADATA"))
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert metadata["Version"].endswith("+cu130") and metadata["Summary"].startswith("Scale a tensor")
    assert metadata["License-Expression"] == "MIT" and "ember-info = ember.cli:main" in entry_points
    requires = metadata.get_all("Requires-Dist")
    assert 'pytest; extra == "test"' in requires and any(r.startswith("torch==") for r in requires)
    for variant, cuda in (("cu130", True), ("cpu", False)):
        simple = out / "index" / "nightly" / variant / "simple"
        assert check_local_index(simple).problems == []
        python = make_venv(tmp_path / f"venv-{variant}")
        install = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--index-url", simple.as_uri(),
                               "ember-ops"], cwd=tmp_path)
        assert install.returncode == 0, install.stdout + install.stderr
        assert (python.parent / "ember-info").is_file()  # the project's entry point, kept
        if cuda:
            # The cu130 binary links the torch it was built against (2.14.1, CUDA): import it beside that torch.
            site = tmp_path / "cu130-site"
            target = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--target", str(site),
                                  "--index-url", simple.as_uri(), "ember-ops"], cwd=tmp_path)
            assert target.returncode == 0, target.stdout + target.stderr
            python = ensure_env(envs, [CUDA_TORCH], "cu130", 3600).python
            probe = run_in_venv([str(python), "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n" + _EMBER_PROBE],
                                cwd=tmp_path)
        else:
            probe = run_in_venv([str(python), "-c", _EMBER_PROBE], cwd=tmp_path)
        assert probe.returncode == 0, probe.stderr
        found = json.loads(probe.stdout.strip().splitlines()[-1])
        installed_in = site if cuda else python.parent.parent
        assert found.pop("file").startswith(str(installed_in)), variant  # the wheel's copy, not the checkout's
        assert found == {"cuda": cuda, "ok": True}, variant


_EMBER_PROBE = """
import json, torch, ember
x = torch.arange(6, dtype=torch.float32)
ok = bool(torch.equal(torch.ops.ember.scale(x, 2.0), 2.0 * x))
print(json.dumps({"file": ember.__file__, "cuda": ember.cuda_built(), "ok": ok}))
"""
