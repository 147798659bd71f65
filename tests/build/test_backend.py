"""[build] backend = "pep517": the exported archs, the device-code check, the rewritten wheel, and bad input."""

from __future__ import annotations

import shutil
import struct
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest

from kiln.core.errors import CompileError
from kiln.core.manifest import RunManifest
from kiln.tasks.build.backend import build_environ, cmake_arch, hide_cuda_toolkit
from kiln.tasks.project.config import load_config
from kiln.tasks.project.config_build import Toolchain
from kiln.tasks.wheel.assemble import WheelInput, write_wheel
from kiln.tasks.wheel.devicecode import check_wheel, rocm_targets
from kiln.tasks.wheel.rewheel import rewrite_metadata, rewrite_wheel
from tests.helpers.projects import copy_project

_BUNDLE = b"__CLANG_OFFLOAD_BUNDLE__"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.parametrize(("arch", "cmake"), [("8.0", "80-real"), ("9.0a", "90a-real"), ("12.0+PTX", "120")])
def test_cmake_arch_spells_sass_only_unless_ptx_is_asked_for(arch, cmake):
    assert cmake_arch(arch) == cmake


def test_the_backend_sees_the_variant_archs_in_every_form_and_no_inherited_ones():
    base = {"PATH": "/bin", "TORCH_CUDA_ARCH_LIST": "7.5", "PYTORCH_ROCM_ARCH": "gfx900", "NVCC_APPEND_FLAGS": "-G"}
    env = build_environ("cuda", "cu130", ("8.0", "9.0"), Toolchain(), 2, "/opt/cuda", base)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert env["CMAKE_CUDA_ARCHITECTURES"] == env["CUDAARCHS"] == "80-real;90-real"
    assert env["CUDA_HOME"] == "/opt/cuda" and env["PATH"] == "/bin" and env["MAX_JOBS"] == "2"
    assert env["KILN_VARIANT"] == "cu130" and env["KILN_BACKEND"] == "cuda"
    assert "PYTORCH_ROCM_ARCH" not in env and "NVCC_APPEND_FLAGS" not in env
    rocm = build_environ("hip", "rocm", ("gfx90a", "gfx942"), Toolchain(), 2, None, base)
    assert rocm["PYTORCH_ROCM_ARCH"] == "gfx90a;gfx942" and "TORCH_CUDA_ARCH_LIST" not in rocm
    assert rocm["HIP_PLATFORM"] == "amd" and "HIP_PLATFORM" not in env  # hipcc beside nvcc would pick NVIDIA
    cpu = build_environ("cpu", "cpu", (), Toolchain(), 2, "/opt/cuda", base)
    assert not {"TORCH_CUDA_ARCH_LIST", "CMAKE_CUDA_ARCHITECTURES", "PYTORCH_ROCM_ARCH", "CUDA_HOME"} & set(cpu)


def test_a_cpu_variants_build_sees_no_cuda_toolkit_but_every_other_tool_beside_nvcc(tmp_path):
    """A setup.py that builds its CUDAExtension wherever it finds nvcc (or a CUDA_HOME) builds its CPU one."""
    tools, other = tmp_path / "bin", tmp_path / "other"
    for directory, names in ((tools, ("nvcc", "ninja", "cc")), (other, ("git",))):
        directory.mkdir()
        for name in names:
            (directory / name).write_text("#!/bin/sh\n")
            (directory / name).chmod(0o755)
    base = {"PATH": f"{tools}:{other}", "CUDA_HOME": "/opt/cuda", "CUDA_PATH": "/opt/cuda", "HOME": "/root"}
    env = hide_cuda_toolkit(build_environ("cpu", "cpu", (), Toolchain(), 2, "/opt/cuda", base), tmp_path / "shadow")
    assert not {"CUDA_HOME", "CUDA_PATH"} & set(env) and env["HOME"] == "/root"
    assert shutil.which("nvcc", path=env["PATH"]) is None
    assert shutil.which("ninja", path=env["PATH"]) is not None and shutil.which("git", path=env["PATH"]) == \
        str(other / "git")  # a directory without nvcc stays as it is
    assert Path(shutil.which("cc", path=env["PATH"]) or "").resolve() == tools / "cc"
    assert hide_cuda_toolkit(env, tmp_path / "shadow") == env  # again: the same mirror


def test_toolchain_settings_reach_the_compilers_through_their_own_variables():
    toolchain = Toolchain(include_dirs=("/opt/inc dir",), defines=("FAST=1",), nvcc_flags=("--use_fast_math",),
                          hipcc_flags=("-ffast-math",), libraries=("m",), library_dirs=("/opt/lib",))
    env = build_environ("cuda", "cu130", ("8.0",), toolchain, 1, None, {"LDFLAGS": "-s"})
    assert env["NVCC_APPEND_FLAGS"] == "'-I/opt/inc dir' -DFAST=1 --use_fast_math"
    assert env["HIPCC_COMPILE_FLAGS_APPEND"] == "'-I/opt/inc dir' -DFAST=1 -ffast-math"
    assert env["LDFLAGS"] == "-s -L/opt/lib -lm"


def _bundle(*ids: str) -> bytes:
    entries = b"".join(struct.pack("<QQQ", 0, 0, len(i)) + i.encode() for i in ids)
    return b"\x7fELF host code" + _BUNDLE + struct.pack("<Q", len(ids)) + entries + b"code objects"


def test_rocm_targets_are_read_from_the_offload_bundles_of_a_library():
    data = _bundle("host-x86_64-unknown-linux-gnu-", "hipv4-amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-") + _bundle(
        "hipv4-amdgcn-amd-amdhsa--gfx90a")
    assert rocm_targets(data) == {"gfx942", "gfx90a"}
    assert rocm_targets(b"\x7fELF no device code") == frozenset()


def _wheel(tmp_path: Path, files: dict[str, bytes], name: str = "plaincuda-1.0.0-py3-none-any.whl") -> Path:
    metadata = b"Metadata-Version: 2.1\nName: plaincuda\nVersion: 1.0.0\nSummary: own summary\n" \
               b"Requires-Dist: numpy\nRequires-Dist: pytest; extra == \"test\"\n\nThe long description.\n"
    members = {**files, "plaincuda-1.0.0.dist-info/METADATA": metadata,
               "plaincuda-1.0.0.dist-info/entry_points.txt": b"[console_scripts]\nfill = plaincuda:main\n",
               "plaincuda-1.0.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools\n"
                                                  b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    return write_wheel(tmp_path / "built", name, sorted(members.items()), _stamp())


def _stamp():
    from kiln.tasks.wheel.assemble import WheelStamp

    return WheelStamp.for_commit("c" * 40, 1764536823, {"triton": "3.9.0", "torch": "2.13.0+cpu"}, environ={})


def test_a_library_missing_a_requested_rocm_target_fails_naming_missing_and_extra(tmp_path):
    wheel = _wheel(tmp_path, {"plaincuda/libfill.so": _bundle("hipv4-amdgcn-amd-amdhsa--gfx942",
                                                              "hipv4-amdgcn-amd-amdhsa--gfx1100")})
    with pytest.raises(CompileError) as caught:
        check_wheel(wheel, "hip", ("gfx90a", "gfx942"), None)
    assert "plaincuda/libfill.so: missing ROCm ['gfx90a']; extra ROCm ['gfx1100']" in str(caught.value)
    check_wheel(wheel, "hip", ("gfx942", "gfx1100"), None)  # exactly the requested targets: accepted


def test_host_only_libraries_pass_a_cpu_wheel_but_not_a_gpu_wheel_without_any_device_code(tmp_path):
    wheel = _wheel(tmp_path, {"plaincuda/libhost.so": b"\x7fELF host code only"})
    check_wheel(wheel, "cpu", (), None)
    with pytest.raises(CompileError, match=r"no shared library embeds device code .*missing ROCm \['gfx942'\]"):
        check_wheel(wheel, "hip", ("gfx942",), None)
    device = _wheel(tmp_path / "gpu", {"plaincuda/libfill.so": _bundle("hipv4-amdgcn-amd-amdhsa--gfx942")})
    with pytest.raises(CompileError, match=r"extra ROCm \['gfx942'\]"):
        check_wheel(device, "cpu", (), None)


def test_rewritten_metadata_keeps_every_field_but_version_and_requirements():
    original = b"Metadata-Version: 2.4\nName: x\nVersion: 1.0\nSummary: s\nLicense-Expression: MIT\n" \
               b"Requires-Dist: a\nProvides-Extra: t\nRequires-Dist: b; extra == \"t\"\n\nBody text\n"
    message = BytesParser().parsebytes(rewrite_metadata(original, "1.0+cu130", ["a==2", 'b; extra == "t"']))
    assert message["Version"] == "1.0+cu130" and message.get_all("Requires-Dist") == ["a==2", 'b; extra == "t"']
    assert (message["Summary"], message["License-Expression"], message["Provides-Extra"]) == ("s", "MIT", "t")
    assert message.get_payload() == "Body text\n"


def test_a_backend_wheel_gets_the_variant_version_dependencies_and_kilns_aot_artifacts(tmp_path):
    config = load_config(copy_project("plaincuda", tmp_path))
    built = _wheel(tmp_path, {"plaincuda/__init__.py": b"x = 1\n"})
    cubin = tmp_path / "fill__fp32.cubin"
    cubin.write_bytes(b"\x7fELF cubin")
    entries = [{"kernel": "fill", "path": "9.0/fill/fill__fp32.cubin", "sha256": "0" * 64, "size": 10}]
    wheel = rewrite_wheel(config, config.variant("cu130"), "1.0.0.dev5+cu130", built,
                          [WheelInput(cubin, "9.0/fill/fill__fp32.cubin")], entries, tmp_path / "wheels", _stamp())
    assert wheel.name.startswith("plaincuda-1.0.0.dev5+cu130-py3-none-linux_")  # it now carries binaries
    from wheel.wheelfile import WheelFile

    with WheelFile(wheel) as archive:  # reading checks every member against the rewritten RECORD
        names = {n: archive.read(n) for n in archive.namelist()}
    dist_info = "plaincuda-1.0.0.dev5+cu130.dist-info"
    assert not any(n.startswith("plaincuda-1.0.0.dist-info/") for n in names)
    assert names["plaincuda/_aot/9.0/fill/fill__fp32.cubin"] == b"\x7fELF cubin"
    assert b"fill__fp32.cubin" in names["plaincuda/_aot/manifest.json"]
    assert names[f"{dist_info}/entry_points.txt"] == b"[console_scripts]\nfill = plaincuda:main\n"
    metadata = BytesParser().parsebytes(names[f"{dist_info}/METADATA"])
    assert metadata["Version"] == "1.0.0.dev5+cu130" and metadata["Summary"] == "own summary"
    assert metadata.get_all("Requires-Dist") == ["numpy", 'pytest; extra == "test"', "triton==3.9.0"]
    assert b"Root-Is-Purelib: false" in names[f"{dist_info}/WHEEL"]


# Through the build flow, with nvcc: the plaincuda fixture compiles one CUDA file in a few seconds (not slow).

def _build(tmp_path: Path, edit=None):
    from kiln.flows.build import build_flow

    config = copy_project("plaincuda", tmp_path)
    if edit is not None:
        edit(config.parent)
    out = tmp_path / "out"
    state = build_flow(str(config), str(out), version="1.0.0.dev20261130", return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    return state, {u.id: u for u in run.units}, run


CUDA_UNIT = "build/cu130/sm_80+sm_90/plaincuda/pep517"


@needs_nvcc
def test_a_backend_build_uses_the_exported_archs_and_its_wheel_holds_exactly_them(prefect_server, tmp_path):
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    state, units, run = _build(tmp_path)
    assert state.is_completed(), state.message
    assert units[CUDA_UNIT].state == "completed" and units["build/cpu/-/plaincuda/pep517"].state == "completed"
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    assert wheels["cu130"].name.startswith("plaincuda-1.0.0.dev20261130+cu130-")
    contents = wheel_contents(wheels["cu130"], find_cuobjdump())
    assert {n: c.sass for n, c in contents.items()} == {"plaincuda/libfill.so": {"sm_80", "sm_90"}}
    with zipfile.ZipFile(wheels["cpu"]) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]


@needs_nvcc
def test_a_failing_backend_build_fails_its_unit_with_the_log_tail_and_other_variants_still_build(
        prefect_server, tmp_path):
    def break_source(repo: Path) -> None:
        (repo / "csrc" / "fill.cu").write_text("this is not CUDA;\n")

    state, units, run = _build(tmp_path, break_source)
    assert state.is_failed()
    failed = units[CUDA_UNIT]
    assert failed.state == "failed" and "the build backend failed for plaincuda (variant cu130" in failed.message
    assert "fill.cu" in failed.message and "error" in failed.message  # nvcc's own words, from the log's tail
    assert units["build/cu130/wheel"].state == "skipped"
    assert units["build/cpu/-/plaincuda/pep517"].state == "completed" and units["build/cpu/wheel"].state == "completed"
    assert [a.variant for a in run.artifacts_of("wheel")] == ["cpu"]


@needs_nvcc
def test_a_build_that_ignores_the_exported_archs_fails_naming_the_missing_and_extra_ones(prefect_server, tmp_path):
    def ignore_archs(repo: Path) -> None:
        setup = repo / "setup.py"
        setup.write_text(setup.read_text().replace("*gencode(archs)]", "*gencode(\"75-real\")]"))

    state, units, _ = _build(tmp_path, ignore_archs)
    assert state.is_failed()
    message = units[CUDA_UNIT].message
    assert "plaincuda/libfill.so: missing SASS ['sm_80', 'sm_90']; extra SASS ['sm_75']" in message, message
    assert units["build/cpu/wheel"].state == "completed"
