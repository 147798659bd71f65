"""A wheel scikit-build-core (CMake) or meson-python (meson) builds out of tree holds only libraries its build
compiled: one whose build installs a prebuilt library from its sources instead of compiling it fails its unit
naming the file; the fixture compiled as it is passes. Each backend is fetched from the package index as the
fixture's pinned build requirement."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.wheel.compiled_here import code_digest
from tests.helpers.projects import copy_project

needs_cc = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("cmake") is None,
                              reason="needs a C compiler and cmake")


def _build(tmp_path: Path, edit=None, fixture: str = "cmakeops"):
    from kiln.flows.build import build_flow

    config = copy_project(fixture, tmp_path)
    if edit is not None:
        edit(config.parent)
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.0.dev20261206", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    return state, {u.id: u for u in run.units}, run


def _prebuilt(repo: Path) -> None:
    """A library built elsewhere (here by cc, before the build) in the sources."""
    (repo / "prebuilt").mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(repo / "prebuilt" / "libops.so"), str(repo / "ops.c")],
                   check=True, timeout=120)


def _cmake_installs_a_prebuilt_library(repo: Path) -> None:
    _prebuilt(repo)
    (repo / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.15)\nproject(cmakeops LANGUAGES NONE)\n"
                                         "install(FILES prebuilt/libops.so DESTINATION cmakeops)\n")


def _meson_installs_a_prebuilt_library(repo: Path) -> None:
    _prebuilt(repo)
    (repo / "meson.build").write_text(
        "project('mesonops', 'c', version: '1.0.0')\npy = import('python').find_installation(pure: false)\n"
        "install_data('prebuilt/libops.so', install_dir: py.get_install_dir() / 'mesonops')\n"
        "py.install_sources('mesonops/__init__.py', subdir: 'mesonops')\n")


@needs_cc
@pytest.mark.parametrize(("fixture", "cheat", "library", "system"), [
    ("cmakeops", _cmake_installs_a_prebuilt_library, "cmakeops/libops.so", "CMake (scikit-build-core)"),
    ("mesonops", _meson_installs_a_prebuilt_library, "mesonops/libops.so", "meson (meson-python)"),
])
def test_an_out_of_tree_build_that_installs_a_prebuilt_library_fails_naming_it_and_a_compiled_one_passes(
        prefect_server, tmp_path, fixture, cheat, library, system):
    state, units, run = _build(tmp_path / "compiled", fixture=fixture)
    assert state.is_completed(), state.message
    wheel = next(run.root / a.path for a in run.artifacts_of("wheel"))
    with zipfile.ZipFile(wheel) as archive:
        assert [n for n in archive.namelist() if n.endswith(".so")] == [library]
    state, units, _ = _build(tmp_path / "prebuilt", cheat, fixture=fixture)
    assert state.is_failed()
    message = units[f"build/cpu/-/{fixture}/pep517"].message
    assert f"put libraries in its wheel that it did not compile: ['{library}']" in message, message
    assert f"{system} build tree" in message, message


def test_the_code_digest_is_the_text_sections_so_an_installs_rpath_edit_keeps_it(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "a.c"
    source.write_text("int f(void) { return 7; }\n")
    built = tmp_path / "liba.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-rpath,/build/tree/lib", "-o", str(built), str(source)],
                   check=True, timeout=120)
    data = built.read_bytes()
    edited = data.replace(b"/build/tree/lib", b"$ORIGIN/x".ljust(15, b"\0"))  # an install's RPATH change, in place
    assert len(edited) == len(data) and edited != data and code_digest(edited) == code_digest(data)
    other = tmp_path / "libb.so"
    source.write_text("int f(void) { return 8; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(other), str(source)], check=True, timeout=120)
    assert code_digest(other.read_bytes()) != code_digest(data)
    assert code_digest(b"not an ELF") == code_digest(b"not an ELF") != code_digest(b"not an ELF either")
