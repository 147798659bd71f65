"""Kiln's nvcc for a package's build splits a compile for several archs into one compile per arch: which commands
it splits (pure argument reading), and the dependency file and statistics it writes for the build. The real nvcc
through the real compile cache: tests/build/test_compile_cache_pep517.py (an added arch compiles alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.build.nvcc_split import DEPFILE, OBJECT, _labelled_stats, _rewrite_depfile, plan_split

# torch's cpp_extension compiles a .cu this way (ninja's rule, flags abridged)
TORCH = ["--generate-dependencies-with-compile", "--dependency-output", "build/ops.o.d", "-I/env/include", "-c",
         "csrc/ops.cu", "-o", "build/ops.o", "-O3", "--compiler-options", "'-fPIC'", "-gencode=arch=compute_80,"
         "code=sm_80", "-gencode=arch=compute_90,code=[sm_90,compute_90]", "--threads", "4", "-std=c++17"]


def test_a_torch_compile_for_two_archs_is_split_per_arch_keeping_every_other_flag_in_order():
    split = plan_split(TORCH)
    assert split is not None
    assert split.parts == (("sm_80", ("-gencode", "arch=compute_80,code=sm_80")),
                           ("sm_90", ("-gencode", "arch=compute_90,code=sm_90", "-gencode",
                                      "arch=compute_90,code=compute_90")))
    assert split.args == ("--generate-dependencies-with-compile", "--dependency-output", DEPFILE, "-I/env/include",
                          "-c", "csrc/ops.cu", "-o", OBJECT, "-O3", "--compiler-options", "'-fPIC'", "--threads",
                          "4", "-std=c++17")
    assert (split.source, split.obj, split.depfile, split.threads) == ("csrc/ops.cu", "build/ops.o",
                                                                         "build/ops.o.d", 4)


def test_one_code_list_over_two_archs_splits_by_each_codes_arch():
    split = plan_split(["-c", "k.cu", "-o=k.o", "-arch", "compute_80", "-code", "sm_80,sm_86,compute_80"])
    assert split is not None and split.threads == 1
    assert split.parts == (("sm_80", ("-gencode", "arch=compute_80,code=sm_80", "-gencode",
                                      "arch=compute_80,code=compute_80")),
                           ("sm_86", ("-gencode", "arch=compute_80,code=sm_86")))


@pytest.mark.parametrize("args", [
    ["-c", "k.cu", "-o", "k.o", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"],  # one arch
    ["-shared", "k.o", "-o", "k.so", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
    ["-c", "k.cu", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],  # no -o
    ["-c", "k.cu", "j.cu", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80", "-arch=sm_90"],
    ["-c", "-rdc=true", "k.cu", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80", "-gencode",
     "arch=compute_90,code=sm_90"],
    ["-dc", "-c", "k.cu", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
    ["-c", "k.cu", "-o", "k.o", "-Xfatbin=-compress-all", "-gencode", "arch=compute_80,code=sm_80", "-gencode",
     "arch=compute_90,code=sm_90"],
    ["-c", "-MD", "k.cu", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
    ["-c", "k.cpp", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"],
    ["-c", "k.cu", "-o", "k.o", "-arch=native"],  # a target nvcc itself must read
], ids=["one-arch", "a-link", "no-output", "two-sources", "rdc", "device-c", "fatbin-options",
        "depfile-by-name", "no-cu", "unreadable"])
def test_a_command_that_is_not_one_compile_of_a_cu_for_several_archs_runs_as_it_came(args):
    assert plan_split(args) is None


def test_relocatable_device_code_turned_off_by_name_is_split():
    assert plan_split(["-c", "-rdc=false", "k.cu", "-o", "k.o", "-gencode", "arch=compute_80,code=sm_80",
                       "-gencode", "arch=compute_90,code=sm_90"]) is not None


def test_the_first_archs_dependency_file_names_the_object_the_build_asked_for(tmp_path: Path):
    written = tmp_path / "sm_80.d"
    written.write_text("build/ops.o.kiln-arch/sm_80.o : csrc/ops.cu \\\n    /env/include/torch.h\n")
    _rewrite_depfile(written, str(tmp_path / "ops.o.d"), "build/ops.o.kiln-arch/sm_80.o", "build/ops.o")
    assert (tmp_path / "ops.o.d").read_text() == "build/ops.o : csrc/ops.cu \\\n    /env/include/torch.h\n"


def test_each_archs_statistics_name_the_source_with_its_arch(tmp_path: Path):
    log = tmp_path / "sm_90.stats"
    log.write_text("# /unit/src/csrc/ops.cu\ndirect_cache_hit\n")
    assert _labelled_stats(log, "sm_90") == "# /unit/src/csrc/ops.cu [sm_90]\ndirect_cache_hit\n"
    assert _labelled_stats(tmp_path / "none.stats", "sm_90") == ""  # a compile ccache did not log
