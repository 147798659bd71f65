"""A torch C++ extension's aarch64 cell, cross-built on this x86_64 builder: exactop (an op on torch's ordinary C++
API) with ``platform = ["aarch64"]`` and torch pinned by its variant. The build fetches the aarch64 torch 2.13.0
wheel from the machine's index (PyPI's), compiles against its headers with Debian's aarch64 cross compiler and
links its libraries; the wheel is an aarch64 ELF that needs exactly torch's libraries, auditwheel tags it
``manylinux_*_aarch64``, and it requires the torch it was built against. A torch the variant does not pin
exactly is refused before anything builds, naming the fix."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from email.parser import BytesParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kiln.core.errors import ConfigError
from kiln.core.manifest import RunManifest
from kiln.tasks.build import cross
from kiln.tasks.build.cross import check_cross_cells
from kiln.tasks.project.config import load_config
from kiln.tasks.project.config_project import pinned_version
from tests.helpers.cuda_torch import link_shared_envs, shared_envs_root
from tests.helpers.gitrepo import git_project

AARCH64 = cross.target("aarch64")
EM_AARCH64 = 183


def _aarch64_cell(pin: str) -> Callable[[Path], None]:
    def edit(repo: Path) -> None:
        config = repo / "kiln.toml"
        text = config.read_text().replace('torch = ["2.13.0", "2.14.1"]',
                                          f'build_requires = ["{pin}"]\npython = ["3.11"]\nplatform = ["aarch64"]')
        assert "platform = [\"aarch64\"]" in text, "the exactop fixture's variant changed"
        config.write_text(text)
    return edit


def test_the_torch_a_cross_build_links_is_the_one_its_variant_pins_exactly():
    assert pinned_version(["setuptools", "torch==2.13.0"]) == "2.13.0"
    assert pinned_version(["torch>=2.13"]) is None and pinned_version(["torch==2.13.*"]) is None
    assert pinned_version(["numpy==2.0"]) is None and pinned_version([]) is None


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the fixture's aarch64 cell is for CPython 3.11")
def test_an_aarch64_torch_cell_whose_torch_is_not_pinned_exactly_is_refused_before_anything_builds(tmp_path):
    config = load_config(git_project("exactop", tmp_path, edit=_aarch64_cell("torch>=2.13")))
    with pytest.raises(ConfigError, match=r"pin torch exactly in the variant's build_requires \(torch==X.Y.Z"):
        check_cross_cells(config, machine="x86_64")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the fixture's aarch64 cell is for CPython 3.11")
@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 C++ cross compiler (Debian: g++-aarch64-linux-gnu)")
def test_a_torch_extensions_aarch64_cell_links_the_aarch64_torch_and_is_tagged_manylinux_aarch64(
        prefect_server, tmp_path):
    from kiln.flows.build import build_flow

    config = git_project("exactop", tmp_path, edit=_aarch64_cell("torch==2.13.0"))
    link_shared_envs(config.parent, shared_envs_root())  # the torch 2.13.0 environment other builds share
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="0.1.0.dev20261207", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    assert state.is_completed(), {u.id: (u.state, u.message) for u in run.units if u.state != "completed"}
    wheels = [run.root / a.path for a in run.artifacts_of("wheel")]
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    # auditwheel's tag: Debian 12's cross g++ (GCC 12) links libstdc++ symbol versions past manylinux_2_28
    assert re.fullmatch(r"exactop-0\.1\.0\.dev20261207\+cpu-cp311-cp311-manylinux_2_\d+_aarch64\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        library = next(n for n in archive.namelist() if n.startswith("exactop/_C") and n.endswith(".so"))
        data = archive.read(library)
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = BytesParser().parsebytes(archive.read(info)).get_all("Requires-Dist") or []
    assert library.endswith(".cpython-311-aarch64-linux-gnu.so"), library
    assert int.from_bytes(data[18:20], "little") == EM_AARCH64  # e_machine: an aarch64 library
    readelf = shutil.which("aarch64-linux-gnu-readelf") or "readelf"
    (tmp_path / "lib.so").write_bytes(data)
    dynamic = subprocess.run([readelf, "-d", str(tmp_path / "lib.so")], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    needed = {line.split("[", 1)[1].split("]", 1)[0] for line in dynamic.splitlines() if "(NEEDED)" in line}
    assert {"libc10.so", "libtorch_cpu.so"} <= needed, needed  # linked against torch's aarch64 libraries
    assert [str(Requirement(r).specifier) for r in requires if Requirement(r).name == "torch"] == ["==2.13.*"]
    staged = cross.default_cache_dir() / "torch-2.13.0-cp311-aarch64"
    assert (staged / "torch" / "lib" / "libtorch_cpu.so").is_file()  # staged once, for the next build
