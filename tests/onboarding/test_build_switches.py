"""kiln init reads every build switch a package's own files name, and says what it could not check or had to
assume: one fixture per way a real package's first nightly went wrong (a CUDA-runtime-only C++ build, optional
ops, a CPU build behind a switch, a setuptools-driven CMake build with its own arch variable, an sdist missing
its native sources, a package that declares no requires-python)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.onboarding import init_project
from kiln.tasks.onboarding.names import parse_setup_py
from kiln.tasks.onboarding.switches import classify, read_switches
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import FIXTURES


def _package(name: str, dest: Path) -> Path:
    repo = dest / name
    shutil.copytree(FIXTURES / name, repo, ignore=shutil.ignore_patterns("__pycache__", "kiln.toml"))
    return repo


def _variants(path: Path) -> dict[str, dict[str, str]]:
    return {v.name: dict(v.build_env) for v in load_config(path).variants}


def test_a_cpp_build_linked_against_the_cuda_runtime_is_a_gpu_variant_with_the_cuda_major_it_requires(
        tmp_path, capsys):
    repo = _package("cudartops", tmp_path)
    assert main(["init", str(repo)]) == 0
    assert _variants(repo / "kiln.toml") == {"cu130": {"CUDART_OPS_CUDA_MAJOR": "13"}}  # no CPU path to build
    err = capsys.readouterr().err
    assert "kiln init: assumed CUDART_OPS_CUDA_MAJOR=13: the CUDA version of kiln init's default GPU variant" in err
    text = (repo / "kiln.toml").read_text()
    assert "# ASSUMED (the package does not say; check it): CUDART_OPS_CUDA_MAJOR=13" in text
    assert "build_env CUDART_OPS_CUDA_MAJOR=13: setup.py requires the CUDA version" in text  # os.environ[] via a helper


def test_an_optional_ops_package_builds_its_ops_in_the_gpu_variant_and_is_portable_without_them(tmp_path):
    result = init_project(_package("optops", tmp_path))
    assert _variants(result.path) == {"cu130": {"OPTOPS_BUILD_OPS": "1"}, "cpu": {}}
    assert "OPTOPS_VERBOSE (other, setup.py)" in result.findings.also_read  # read, listed, not set
    assert "#   OPTOPS_VERBOSE (other, setup.py)" in result.text
    assert any(r.startswith("a CPU variant: the portable wheel, built without OPTOPS_BUILD_OPS")
               for r in result.findings.reasons)


def test_a_cpu_build_behind_a_switch_gets_the_switch_in_each_variant(tmp_path):
    result = init_project(_package("cpuswitch", tmp_path))
    assert _variants(result.path) == {"cu130": {"SWOPS_CUDA_EXT": "1"}, "cpu": {"SWOPS_CUDA_EXT": "0"}}
    assert "a CPU variant: SWOPS_CUDA_EXT=0 opens its CPU path" in result.findings.reasons


def test_a_setuptools_driven_cmake_build_gets_its_own_arch_variable_from_the_variants_archs(tmp_path):
    result = init_project(_package("cmakearch", tmp_path))
    assert _variants(result.path)["cu130"] == {"CMARCH_CUDA_ARCHS": "90-real"}  # CMake's spelling, SASS only
    assert any("setup.py drives a CMake build (its CMakeLists.txt)" in r for r in result.findings.reasons)
    assert not any("torch.utils.cpp_extension" in r for r in result.findings.reasons)  # it only imports CUDA_HOME
    assert result.findings.also_read == ()  # CMAKE_BUILD_PARALLEL_LEVEL is Kiln's; an unrelated option() is no switch


def test_an_sdist_missing_the_sources_its_build_names_is_a_warning_a_header_line_and_exit_status_1(
        tmp_path, capsys):
    repo = _package("hollow", tmp_path)
    assert main(["init", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "kiln init: warning: its build names native sources" in err
    assert "csrc/hollow.cpp, csrc/hollow_kernel.cu" in err
    assert "# WARNING: its build names native sources this tree does not hold (csrc/hollow.cpp," in (
        (repo / "kiln.toml").read_text())
    (repo / "csrc").mkdir()
    (repo / "csrc" / "hollow.cpp").write_text("")
    (repo / "csrc" / "hollow_kernel.cu").write_text("")
    (repo / "kiln.toml").unlink()
    assert main(["init", str(repo)]) == 0 and "warning" not in capsys.readouterr().err


def test_the_init_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 written; 1 written, but its build names native sources" in out


def test_a_requires_python_the_package_does_not_declare_is_said_in_the_header_and_on_stderr(tmp_path, capsys):
    repo = _package("optops", tmp_path)
    assert main(["init", str(repo)]) == 0
    assert "kiln init: assumed requires_python '>=3.10': the package declares none" in capsys.readouterr().err
    assert "# ASSUMED (the package does not say; check it): requires_python '>=3.10'" in (
        (repo / "kiln.toml").read_text())
    declared = init_project(_package("cpuswitch", tmp_path / "b"))  # python_requires=">=3.9": nothing assumed
    assert declared.findings.assumed == () and "ASSUMED" not in declared.text


@pytest.mark.parametrize(("name", "role"), [
    ("FLASH_ATTENTION_FORCE_BUILD", "download"), ("FORCE_CUDA", "force_cuda"), ("X_SKIP_CUDA_BUILD", "skip_cuda"),
    ("X_CUDA_EXT", "cuda_toggle"), ("WITH_CUDA", "cuda_toggle"), ("DS_BUILD_OPS", "build_ops"),
    ("TORCH_CUDA_ARCH_LIST", "archs"), ("X_CUDA_ARCHS", "archs"), ("CMARCH_WITH_TESTS", "other"),
    ("X_CUDA_MAJOR", "cuda_version"), ("CUDA_VERSION", "cuda_version"), ("MAX_JOBS", "parallelism"),
    ("NVCC_THREADS", "parallelism"), ("X_LOCAL_VERSION", "version_suffix"), ("USE_ROCM", "rocm"),
    ("CUDA_HOME", "other"),
])
def test_each_variable_is_classified_by_what_it_controls(name, role):
    assert classify(name) == role


def test_switches_are_read_through_constants_helpers_cmake_and_pyproject_without_running_anything():
    setup_py = ('import os\nOPS = "K_BUILD_OPS"\n'
                'def flag(key, default="0"):\n    return os.environ.get(key, default).lower() in ("1", "true")\n'
                'if flag(OPS):\n    raise SystemExit("never run")\n'
                'if "K_USE_ROCM" in os.environ:\n    pass\narchs = os.getenv("K_ARCH_LIST", "8.0;9.0")\n')
    cmake = 'set(K_ARCHS "$ENV{K_TARGET_ARCHS}")\nset_target_properties(k PROPERTIES CUDA_ARCHITECTURES ${K_ARCHS})\n'
    config = '[tool.scikit-build.cmake.define]\nK_DEBUG = {env = "K_DEBUG_BUILD", default = "OFF"}\n'
    found = read_switches(setup_py, parse_setup_py(setup_py), cmake, config, ("8.0", "9.0"), "13.0")
    assert dict(found.gpu_env) == {"K_BUILD_OPS": "1", "K_ARCH_LIST": "8.0;9.0", "K_TARGET_ARCHS": "80-real;90-real"}
    assert found.also_read == ("K_USE_ROCM (the ROCm build, setup.py)",
                               "K_DEBUG_BUILD (other, pyproject.toml/setup.cfg)")


def test_init_check_says_which_switch_a_kiln_toml_lacks_and_passes_the_file_init_wrote(tmp_path, capsys):
    repo = _package("optops", tmp_path)
    assert main(["init", "--check", str(repo)]) == 2  # nothing to check yet
    assert "does not exist: kiln init --check compares" in capsys.readouterr().err
    assert main(["init", str(repo)]) == 0
    assert main(["init", "--check", str(repo)]) == 0
    assert "kiln.toml agrees with what the build reads" in capsys.readouterr().out
    text = (repo / "kiln.toml").read_text()
    (repo / "kiln.toml").write_text(text.replace('build_env = { OPTOPS_BUILD_OPS = "1" }', ""))
    assert main(["init", "--check", str(repo)]) == 1
    out = capsys.readouterr().out
    assert ("kiln init --check: [[variants]] cu130 build_env: OPTOPS_BUILD_OPS = '1' is what its build needs, it is"
            " not set (setup.py compiles its ops only when it is set;") in out


def test_a_failed_build_says_the_setting_to_change_from_what_it_printed_and_what_its_build_reads(tmp_path):
    from kiln.tasks.onboarding.advice import what_to_set

    cudart = _package("cudartops", tmp_path)
    log = "Traceback (most recent call last):\n  ...\nKeyError: 'CUDART_OPS_CUDA_MAJOR'\n"
    assert what_to_set(cudart, "cu130", "cuda", {}, log) == [
        "its build printed \"KeyError: 'CUDART_OPS_CUDA_MAJOR'\": add CUDART_OPS_CUDA_MAJOR = \"13\" to"
        " [[variants]] cu130 build_env"]
    optops = _package("optops", tmp_path)
    [line] = what_to_set(optops, "cu130", "cuda", {}, "variant cu130: optops-2.1.1-py3-none-any.whl holds no shared"
                         " library, so no cuda device code at all")
    assert line.startswith("the wheel holds no shared library and setup.py compiles its ops only when it is set")
    assert line.endswith('add OPTOPS_BUILD_OPS = "1" to [[variants]] cu130 build_env')
    assert what_to_set(optops, "cu130", "cuda", {"OPTOPS_BUILD_OPS": "1"}, "error: nvcc died") == []
    switch = _package("cpuswitch", tmp_path)
    assert what_to_set(switch, "cpu", "cpu", {}, "SWOPS_CUDA_EXT=1 needs a CUDA torch; set SWOPS_CUDA_EXT=0") == [
        "its build printed 'SWOPS_CUDA_EXT=1 needs a CUDA torch; set SWOPS_CUDA_EXT=0': add SWOPS_CUDA_EXT = \"0\" to"
        " [[variants]] cpu build_env"]


def test_a_switch_compared_with_its_off_value_or_on_by_default_is_never_written_off():
    setup_py = ('import os\nif os.getenv("M_WITH_OPS", "1") == "0":\n    pass\n'
                'if os.getenv("Q_FORCE_CUDA", "0") == "0":\n    pass\n')
    found = read_switches(setup_py, parse_setup_py(setup_py))
    assert dict(found.gpu_env) == {"Q_FORCE_CUDA": "1"}  # "== '0'" tests for off; on is the other value
    assert found.also_read == ("M_WITH_OPS (builds the ops ahead of time, setup.py)",)  # built unless switched off


def test_a_scikit_build_core_cmake_option_that_opens_cuda_is_written_through_skbuild_cmake_define():
    config = '[build-system]\nrequires = ["scikit-build-core"]\nbuild-backend = "scikit_build_core.build"\n'
    top = ('option(USE_CUDA "Enable CUDA-accelerated training " OFF)\noption(USE_OPENMP "OpenMP" ON)\n'
           'option(BUILD_CLI "the command line" OFF)\n')
    vendored = 'option(NANOARROW_DEVICE_WITH_CUDA "a vendored library\'s" OFF)\n'
    switches = read_switches("", None, top + vendored, config, top_cmake=top)
    assert dict(switches.gpu_env) == {"SKBUILD_CMAKE_DEFINE": "USE_CUDA=ON"}  # its own CUDA option, nothing else
    assert any("SKBUILD_CMAKE_DEFINE USE_CUDA=ON" in reason for reason in switches.reasons)
    setuptools = read_switches("", None, top, "[build-system]\nbuild-backend = \"setuptools.build_meta\"\n",
                               top_cmake=top)
    assert "SKBUILD_CMAKE_DEFINE" not in dict(setuptools.gpu_env)  # only scikit-build-core reads that variable
