"""nvcc units: exactly the filtered -gencode list, the embedded arch list checked, a clear skip without nvcc."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.core.errors import CompileError, ToolchainMissingError
from kiln.tasks.build import nvcc as nvcc_mod
from kiln.tasks.build.nvcc import build_library, find_nvcc, gencode_flags
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.wheel.devicecode import embedded_archs, expected_contents

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "kernels" / "kiln_kernels" / "csrc" / "silu_and_mul.cu"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.parametrize(("archs", "flags"), [
    (("8.0",), ["-gencode", "arch=compute_80,code=sm_80"]),
    (("9.0a", "12.0+PTX"), ["-gencode", "arch=compute_90a,code=sm_90a",
                            "-gencode", "arch=compute_120,code=[sm_120,compute_120]"]),
])
def test_gencode_flags_are_exactly_the_planned_archs(archs, flags):
    assert gencode_flags(archs) == flags


def test_native_is_refused_in_gencode():
    with pytest.raises(Exception, match="'native' is refused"):
        gencode_flags(("native",))


def test_missing_nvcc_is_a_clear_toolchain_error(tmp_path):
    with pytest.raises(ToolchainMissingError, match=f"nvcc not found at {tmp_path}/nope/nvcc"):
        find_nvcc(str(tmp_path / "nope" / "nvcc"))


def test_missing_nvcc_skips_cuda_cpp_units_and_keeps_triton_units(tmp_path):
    setup = prepare_build(str(REPO / "kiln.toml"), "0.1.0", ["cu130"], nvcc_path=str(tmp_path / "nope" / "nvcc"))
    csrc_skips = [s for s in setup.plan.skips if s.id.startswith("build/cu130/-/silu_and_mul/")]
    (skip,) = csrc_skips
    assert "CUDA C++ units skipped: nvcc not found" in skip.reason and "Triton units still build" in skip.reason
    assert setup.nvcc is None
    assert [u for u in setup.plan.units if u.kind == "triton"]
    assert not [u for u in setup.plan.units if u.kind == "nvcc"]


@pytest.mark.slow
@needs_nvcc
def test_library_missing_a_planned_arch_is_a_compile_error(monkeypatch):
    # Fault injection: a -gencode list that silently drops the last arch, as a typo would; each arch
    # compiles in its own call, whose flags are then empty (nvcc's default arch).
    real = nvcc_mod.gencode_flags
    monkeypatch.setattr(nvcc_mod, "gencode_flags", lambda archs: real(tuple(a for a in archs if a != "9.0")))
    with pytest.raises(CompileError, match=r"compiled for sm_90 alone embeds device code for \['sm_75'\]"):
        build_library(find_nvcc(), [SOURCE], "libkiln_csrc.so", ("8.0", "9.0"), timeout=600)


@pytest.mark.slow
@needs_nvcc
def test_nvcc_builds_two_archs_and_the_library_embeds_exactly_them(tmp_path):
    nvcc = find_nvcc()
    library = tmp_path / "lib.so"
    library.write_bytes(build_library(nvcc, [SOURCE], "lib.so", ("8.0", "9.0+PTX"), timeout=600))
    assert embedded_archs(library, nvcc.cuobjdump) == expected_contents(("8.0", "9.0+PTX")) == ({"sm_80", "sm_90"}, {"sm_90"})


def test_a_tool_past_its_deadline_goes_down_the_shared_ladder_with_its_children(tmp_path):
    """The tool's subprocess (as nvcc's cicc/ptxas would be) dies with it: the whole group is signalled."""
    from tests.helpers.procs_tree import running

    pid_file = tmp_path / "child.pid"
    script = f"sleep 600 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; echo started; wait"
    with pytest.raises(CompileError, match="ran past its 2 s deadline; process group ended by sigterm") as info:
        nvcc_mod.run_tool(["sh", "-c", script], timeout=2)
    assert "started" in str(info.value)
    assert not running(int(pid_file.read_text()))


def test_a_tool_with_more_output_than_a_pipe_holds_finishes(tmp_path):
    result = nvcc_mod.run_tool(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; echo; exit 3"], timeout=120)
    assert result.returncode == 3 and result.stdout.count("x") == 300000


@pytest.mark.slow
@needs_nvcc
def test_the_same_sources_at_two_paths_of_different_length_give_identical_library_bytes(tmp_path):
    # Invariant 8: scale-out workers clone into fresh directories; the torch extension (ops.cpp, which uses
    # TORCH_CHECK's __FILE__) and the kernel (an anonymous namespace nvcc names after its file's path) both count.
    from kiln.tasks.build.nvcc import torch_settings

    nvcc = find_nvcc()
    built = []
    for clone in (tmp_path / "a", tmp_path / "a-much-longer-clone-directory" / "nested"):
        shutil.copytree(SOURCE.parent, clone / "csrc")
        sources = sorted((clone / "csrc").glob("*.c*"))
        library = build_library(nvcc, sources, "lib.so", ("8.0",), timeout=600, settings=torch_settings())
        assert str(clone).encode() not in library
        built.append(library)
    assert built[0] == built[1]


def test_the_staging_directory_refuses_one_another_user_could_write(tmp_path):
    from kiln.tasks.build import stagedir

    base = tmp_path / "tmp"
    base.mkdir()
    shared = base / f"kiln-nvcc-{__import__('os').getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CompileError, match="not a private directory"), stagedir.fixed_sources([SOURCE], "lib", 5, base=base):
        pass
    assert list(shared.iterdir()) == []
