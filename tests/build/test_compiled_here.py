"""A wheel scikit-build-core (CMake) builds out of tree holds only libraries its build compiled: one whose CMake
installs a prebuilt library from its sources instead of compiling it fails its unit naming the file; the
fixture compiled as it is passes. scikit-build-core is fetched from the package index as a build requirement."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.build.compiled_here import code_digest
from tests.build.conftest import copy_project

needs_cc = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("cmake") is None,
                              reason="needs a C compiler and cmake")
UNIT = "build/cpu/-/cmakeops/pep517"


def _build(tmp_path: Path, edit=None):
    from kiln.flows.build import build_flow

    config = copy_project("cmakeops", tmp_path)
    if edit is not None:
        edit(config.parent)
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.0.dev20261206", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    return state, {u.id: u for u in run.units}, run


def _install_a_prebuilt_library(repo: Path) -> None:
    """CMake compiles nothing and installs a library that was built elsewhere (here by cc, before the build)."""
    (repo / "prebuilt").mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(repo / "prebuilt" / "libops.so"), str(repo / "ops.c")],
                   check=True, timeout=120)
    (repo / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.15)\nproject(cmakeops LANGUAGES NONE)\n"
                                         "install(FILES prebuilt/libops.so DESTINATION cmakeops)\n")


@needs_cc
def test_a_cmake_build_that_installs_a_prebuilt_library_fails_naming_it_and_a_compiled_one_passes(
        prefect_server, tmp_path):
    state, units, run = _build(tmp_path / "compiled")
    assert state.is_completed(), state.message
    wheel = next(run.root / a.path for a in run.artifacts_of("wheel"))
    with zipfile.ZipFile(wheel) as archive:
        assert [n for n in archive.namelist() if n.endswith(".so")] == ["cmakeops/libops.so"]
    state, units, _ = _build(tmp_path / "prebuilt", _install_a_prebuilt_library)
    assert state.is_failed()
    message = units[UNIT].message
    assert "put libraries in its wheel that it did not compile: ['cmakeops/libops.so']" in message, message
    assert "CMake (scikit-build-core) build tree" in message, message


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
