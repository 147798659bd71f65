"""A package's own build (pep517) compiles through Kiln's compile cache: a setuptools C extension of three
translation units built cold compiles all three; a second clone in another folder, with the first one's compile
cache, compiles none (ccache's own statistics) and gives a byte-identical wheel; a one-file change compiles that
file alone, and its wheel equals one built with no compile cache. The compiler shims themselves: the real
compiler behind each, no compile cached twice, the nvcc flags ccache cannot see hashed."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kiln.tasks.build.compile_cache import CompileCache, CompileStats, find_ccache, open_compile_cache
from kiln.tasks.build.compiler_shims import ACTIVE, cached_compilers, unit_stats
from kiln.tasks.build.nvcc import find_cuobjdump
from kiln.tasks.build.stage import compile_context, prepare_build
from kiln.tasks.build.units import UnitResult, build_unit, unit_record
from kiln.tasks.wheel.devicecode import rocm_targets
from tests.helpers.projects import FIXTURES

needs_toolchain = pytest.mark.skipif(shutil.which("gcc") is None or find_ccache() is None,
                                     reason="gcc or ccache is not installed")
SOURCES = ["csrc/add.c", "csrc/module.c", "csrc/mul.c"]


def _clone(dest: Path, name: str = "cmulti") -> Path:
    shutil.copytree(FIXTURES / name, dest, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    return dest


def _build(project: Path, cache: Path, out: Path, compile_cache: bool = True) -> tuple[UnitResult, Path]:
    """The cpu unit built the way the build stage builds it; its result and its wheel."""
    setup = prepare_build(str(project / "kiln.toml"), "1.0.0", None, cache_dir=str(cache))
    assert setup.project is not None and (setup.project.compile_cache is not None) is bool(find_ccache())
    if not compile_cache:
        setup = dataclasses.replace(setup, project=dataclasses.replace(setup.project, compile_cache=None))
    (unit,) = setup.plan.units
    with compile_context(setup, out) as context:
        result = build_unit(unit, context)
    assert result.cache == "miss"
    (wheel,) = [f for f in result.files if f.name.endswith(".whl")]
    return result, wheel


def _library(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".so")]
        return archive.read(name)


@pytest.mark.slow
@needs_toolchain
def test_a_setuptools_build_compiles_each_translation_unit_once_across_clones_and_one_changed_file_alone(tmp_path):
    first = _clone(tmp_path / "w1")
    cold, cold_wheel = _build(first, tmp_path / "cache-1", tmp_path / "out-1")
    assert cold.compile is not None and sorted(cold.compile.compiled) == SOURCES and cold.compile.reused == ()
    assert "3 of 3 translation units compiled, 0 reused" in unit_record(_unit(), cold).message

    # a second clone, at a path of another length, whose worker has the first one's compile cache only
    second = _clone(tmp_path / "worker-two-with-a-longer-path" / "w2")
    shutil.copytree(tmp_path / "cache-1" / "ccache", tmp_path / "cache-2" / "ccache")
    warm, warm_wheel = _build(second, tmp_path / "cache-2", tmp_path / "out-2")
    assert warm.compile == CompileStats((), tuple(SOURCES)), warm.compile
    assert "0 of 3 translation units compiled, 3 reused" in unit_record(_unit(), warm).message
    assert warm_wheel.read_bytes() == cold_wheel.read_bytes()

    # one .c changes: it alone is compiled; the wheel is the one a build without any compile cache gives
    mul = second / "csrc" / "mul.c"
    mul.write_text(mul.read_text().replace("return a * b;", "return b * a + 0 * a;"))
    changed, changed_wheel = _build(second, tmp_path / "cache-2", tmp_path / "out-3")
    assert changed.compile == CompileStats(("csrc/mul.c",), ("csrc/add.c", "csrc/module.c")), changed.compile
    assert _library(changed_wheel) != _library(cold_wheel)
    plain, plain_wheel = _build(second, tmp_path / "cache-3", tmp_path / "out-4", compile_cache=False)
    assert plain.compile is None
    assert plain_wheel.read_bytes() == changed_wheel.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_toolchain
@pytest.mark.parametrize("fixture", ["cmakeops", "mesonops"])
def test_a_cmake_or_meson_build_compiles_through_the_compile_cache_and_a_second_clone_compiles_nothing(
        tmp_path, fixture):
    """scikit-build-core (CMake: the launcher variables, compilers found on PATH) and meson-python (meson puts
    the ccache it finds first on PATH before its compiler), each fetched as the fixture's build requirement."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    cold, cold_wheel = _build(_clone(tmp_path / "w1", fixture), tmp_path / "cache-1", tmp_path / "out-1")
    # CMake's own compiler probe compiles too; it is not the project's and is not counted
    assert cold.compile == CompileStats(("ops.c",), ()), cold.compile
    shutil.copytree(tmp_path / "cache-1" / "ccache", tmp_path / "cache-2" / "ccache")
    warm, warm_wheel = _build(_clone(tmp_path / "a-second-clone" / "w2", fixture), tmp_path / "cache-2",
                              tmp_path / "out-2")
    assert warm.compile == CompileStats((), ("ops.c",)), warm.compile
    assert warm_wheel.read_bytes() == cold_wheel.read_bytes()


def _separate_compile(project: Path, archs: str) -> None:
    """plaincuda's setup.py compiles and links in one nvcc call, which no compile cache serves: compile, then
    link; one CUDA variant of ``archs`` (seconds)."""
    setup_py = project / "setup.py"
    old = ('subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-o", str(out), "csrc/fill.cu", '
           '*gencode(archs)],\n                           check=True, timeout=600)')
    new = ('obj = Path(self.build_lib).parent / "fill.o"\n            subprocess.run(["nvcc", "-c", "-Xcompiler", '
           '"-fPIC", "-o", str(obj), "csrc/fill.cu", *gencode(archs)], check=True, timeout=600)\n            '
           'subprocess.run(["nvcc", "-shared", "-o", str(out), str(obj), *gencode(archs)], check=True, timeout=600)')
    if old in setup_py.read_text():
        setup_py.write_text(setup_py.read_text().replace(old, new))
    assert new in setup_py.read_text(), "plaincuda's setup.py changed: update this test"
    config = project / "kiln.toml"
    config.write_text(re.sub(r"archs = \[[^]]*\]", f"archs = {archs}", config.read_text(), count=1)
                      .replace('[[variants]]\nname = "cpu"\nbackend = "cpu"\n', ""))


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_toolchain
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_an_nvcc_compile_a_setup_py_runs_by_name_is_cached_per_arch_and_an_added_arch_compiles_alone(tmp_path):
    """setup.py's one nvcc call for two archs runs as one cached compile per arch (Kiln's nvcc), nvcc's own host
    compiles run the real gcc (no second ccache); a second clone compiles nothing and its wheel is the same bytes;
    an arch added to the variant compiles that arch alone, and the library holds all three."""
    first = _clone(tmp_path / "w1", "plaincuda")
    _separate_compile(first, '["8.0", "9.0"]')
    cold, cold_wheel = _build(first, tmp_path / "cache-1", tmp_path / "out-1")
    both = ("csrc/fill.cu [sm_80]", "csrc/fill.cu [sm_90]")
    assert cold.compile == CompileStats(both, ()), cold.compile
    second = _clone(tmp_path / "a-second-clone" / "w2", "plaincuda")
    _separate_compile(second, '["8.0", "9.0"]')
    shutil.copytree(tmp_path / "cache-1" / "ccache", tmp_path / "cache-2" / "ccache")
    warm, warm_wheel = _build(second, tmp_path / "cache-2", tmp_path / "out-2")
    assert warm.compile == CompileStats((), both), warm.compile
    assert warm_wheel.read_bytes() == cold_wheel.read_bytes()
    _separate_compile(second, '["8.0", "9.0", "10.0"]')
    wider, wider_wheel = _build(second, tmp_path / "cache-2", tmp_path / "out-3")
    assert wider.compile == CompileStats(("csrc/fill.cu [sm_100]",), both), wider.compile
    (tmp_path / "libfill.so").write_bytes(_library(wider_wheel))
    listed = subprocess.run([find_cuobjdump(), "--list-elf", str(tmp_path / "libfill.so")], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    # the object's three images, and the link's own small one per arch it was given
    assert set(re.findall(r"\.(sm_\d+)\.cubin", listed)) == {"sm_80", "sm_90", "sm_100"}, listed


def _cmake_cuda(project: Path, archs: str) -> Path:
    """cmakeops made a CUDA library: CMake compiles ``ops.c`` and ``fill.cu`` for the variant's ``archs``
    (``CUDAARCHS``), one CUDA variant."""
    (project / "fill.cu").write_text("__global__ void fill(float *x, float v) { x[threadIdx.x] = v; }\n"
                                     'extern "C" void cmakeops_fill(float *x, float v) { fill<<<1, 32>>>(x, v); }\n')
    cmake = project / "CMakeLists.txt"
    cmake.write_text(cmake.read_text().replace("LANGUAGES C)", "LANGUAGES C CUDA)")
                     .replace("MODULE ops.c)", "MODULE ops.c fill.cu)"))
    config = project / "kiln.toml"
    config.write_text(re.sub(r'name = "c[^"]*"\nbackend = "c[a-z]*"\n(archs = .*\n)?',
                             f'name = "cu130"\nbackend = "cuda"\narchs = {archs}\n', config.read_text(), count=1))
    assert "fill.cu)" in cmake.read_text() and f"archs = {archs}" in config.read_text(), "cmakeops changed"
    return project


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_toolchain
@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None, reason="nvcc or cmake missing")
def test_a_cmake_projects_nvcc_compile_is_split_per_arch_by_its_launcher_and_an_added_arch_compiles_alone(tmp_path):
    """scikit-build-core's CMake runs its launcher before the nvcc it found: Kiln's nvcc is that launcher, so each
    arch of the project's ``.cu`` is one cached compile; an arch added to the variant compiles that arch alone,
    and the library holds all three; the wheel is the bytes of a cold build of the three."""
    project = _cmake_cuda(_clone(tmp_path / "w1", "cmakeops"), '["8.0", "9.0"]')
    cold, _ = _build(project, tmp_path / "cache", tmp_path / "out-1")
    both = ("fill.cu [sm_80]", "fill.cu [sm_90]")
    assert cold.compile is not None and sorted(cold.compile.compiled) == [*both, "ops.c"], cold.compile
    _cmake_cuda(project, '["8.0", "9.0", "10.0"]')
    wider, wider_wheel = _build(project, tmp_path / "cache", tmp_path / "out-2")
    assert wider.compile is not None and wider.compile.compiled == ("fill.cu [sm_100]",), wider.compile
    assert sorted(wider.compile.reused) == [*both, "ops.c"], wider.compile
    # all three archs cold, in a second clone: the same bytes as the build two of them came from the cache for
    again = _cmake_cuda(_clone(tmp_path / "a-second-clone" / "w2", "cmakeops"), '["8.0", "9.0", "10.0"]')
    _, cold_wheel = _build(again, tmp_path / "cache-2", tmp_path / "out-3")
    assert cold_wheel.read_bytes() == wider_wheel.read_bytes()
    (tmp_path / "ops.so").write_bytes(_library(wider_wheel))
    listed = subprocess.run([find_cuobjdump(), "--list-elf", str(tmp_path / "ops.so")], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    assert set(re.findall(r"\.(sm_\d+)\.cubin", listed)) == {"sm_80", "sm_90", "sm_100"}, listed


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_toolchain
@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc is not installed (Debian: hipcc, libamdhip64-dev)")
def test_a_hipcc_compile_a_setup_py_runs_by_name_is_cached_and_a_second_clone_compiles_nothing(tmp_path):
    """setup.py compiles one HIP source with hipcc for the variant's two gfx targets, then links it: the compile
    goes through the cache (hipcc's clang named by its version), a second clone compiles nothing, and its wheel is
    the same bytes, holding both targets' code."""
    cold, cold_wheel = _build(_clone(tmp_path / "w1", "plainhip"), tmp_path / "cache-1", tmp_path / "out-1")
    assert cold.compile == CompileStats(("csrc/fill.hip",), ()), cold.compile
    shutil.copytree(tmp_path / "cache-1" / "ccache", tmp_path / "cache-2" / "ccache")
    warm, warm_wheel = _build(_clone(tmp_path / "a-second-clone" / "w2", "plainhip"), tmp_path / "cache-2",
                              tmp_path / "out-2")
    assert warm.compile == CompileStats((), ("csrc/fill.hip",)), warm.compile
    assert warm_wheel.read_bytes() == cold_wheel.read_bytes()
    assert rocm_targets(_library(warm_wheel)) == {"gfx90a", "gfx908"}


def _unit():  # type: ignore[no-untyped-def]
    from kiln.tasks.build.plan import CompileUnit

    return CompileUnit("build/cpu/cmulti", "cpu", "cpu", "", "", "cmulti", "", "", "pep517", "b", "k")


# --- the shims -------------------------------------------------------------------------------------------------

def _fake_tools(where: Path) -> Path:
    """A PATH folder whose gcc and nvcc print how they were called (their argv and the nesting marker)."""
    where.mkdir()
    for name in ("gcc", "nvcc"):
        tool = where / name
        tool.write_text(f"#!/bin/sh\necho {name} \"$@\" marker=${{{ACTIVE}:-unset}}\n")
        tool.chmod(0o755)
    return where


def _cache(tmp_path: Path, launcher: Path) -> CompileCache:
    """A compile cache whose launcher is a recorder standing in for ccache (a fault-free fake: it prints the
    command it would cache, then runs it), so the test sees what each shim hands ccache."""
    launcher.write_text(f"#!/bin/sh\necho ccache \"$@\" marker=${{{ACTIVE}:-unset}}\n\"$@\"\n")
    launcher.chmod(0o755)
    return CompileCache(str(launcher), tmp_path / "ccache-dir")


def test_each_shim_runs_ccache_with_the_real_compiler_and_a_nested_compile_runs_it_directly(tmp_path):
    tools = _fake_tools(tmp_path / "tools")
    cache = _cache(tmp_path, tmp_path / "recorder")
    env = cached_compilers(cache, {"PATH": f"{tools}:/usr/bin:/bin"}, tmp_path / "unit", tmp_path / "shims",
                           tmp_path / "stats.log")
    assert env["PATH"].split(":")[0] == str(tmp_path / "shims") and ACTIVE not in env
    assert env["PYTORCH_NVCC"] == str(tmp_path / "shims" / "nvcc")
    assert env["CCACHE_BASEDIR"] == str(tmp_path / "unit") and env["CCACHE_NOHASHDIR"] == "1"
    launcher = tmp_path / "shims" / "ccache"
    assert {env[f"CMAKE_{lang}_COMPILER_LAUNCHER"] for lang in ("C", "CXX", "CUDA")} == {str(launcher)}

    def run(*cmd: str, extra: dict[str, str] | None = None) -> list[str]:
        done = subprocess.run(cmd, env=env | (extra or {}), capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.splitlines()

    # by name from PATH (setuptools, torch's c++): ccache, then the real compiler under the marker
    assert run("gcc", "-c", "a.c") == [f"ccache {tools}/gcc -c a.c marker=1", "gcc -c a.c marker=1"]
    assert run(env["PYTORCH_NVCC"], "-c", "k.cu")[0] == f"ccache {tools}/nvcc -c k.cu marker=1"
    # nvcc's own host compile, or a CMake launcher before a shim found as the compiler: no second ccache
    assert run("gcc", "-E", "x.c", extra={ACTIVE: "1"}) == ["gcc -E x.c marker=1"]
    assert run(str(launcher), str(tmp_path / "shims" / "gcc"), "-c", "b.c") == [
        f"ccache {tmp_path}/shims/gcc -c b.c marker=1", "gcc -c b.c marker=1"]


def test_cmakes_cuda_launcher_is_kilns_nvcc_taking_the_compiler_cmake_found_first(tmp_path):
    """The nvcc shim CMake found stands for the real nvcc; an nvcc the project named by path is run itself; another
    CUDA compiler (clang) is cached whole; nested below a shim, the compiler runs directly. (One arch: no split.)"""
    tools = _fake_tools(tmp_path / "tools")
    (tools / "clang").write_text((tools / "gcc").read_text().replace("echo gcc", "echo clang"))
    (tools / "clang").chmod(0o755)
    env = cached_compilers(_cache(tmp_path, tmp_path / "recorder"), {"PATH": f"{tools}:/usr/bin:/bin"},
                           tmp_path / "unit", tmp_path / "shims", tmp_path / "stats.log", cuobjdump="/bin/false")
    launcher = env["CMAKE_CUDA_COMPILER_LAUNCHER"]
    assert launcher == str(tmp_path / "shims" / "nvcc-launcher") and env["CMAKE_C_COMPILER_LAUNCHER"] != launcher

    def run(*cmd: str, extra: dict[str, str] | None = None) -> list[str]:
        done = subprocess.run(cmd, env=env | (extra or {}), capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.splitlines()

    shim, one_arch = str(tmp_path / "shims" / "nvcc"), ("-arch=sm_90", "-c", "k.cu", "-o", "k.o")
    assert run(launcher, shim, *one_arch)[0] == f"ccache {tools}/nvcc {' '.join(one_arch)} marker=1"
    other = tmp_path / "cuda-12" / "bin" / "nvcc"
    other.parent.mkdir(parents=True)
    shutil.copy(tools / "nvcc", other)
    assert run(launcher, str(other), *one_arch)[0] == f"ccache {other} {' '.join(one_arch)} marker=1"
    assert run(launcher, str(tools / "clang"), "-c", "k.cu")[0] == f"ccache {tools}/clang -c k.cu marker=1"
    assert run(launcher, shim, "-c", "k.cu", extra={ACTIVE: "1"}) == ["nvcc -c k.cu marker=1"]
    refused = subprocess.run([launcher], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "no compiler to run" in refused.stderr


def test_the_shim_names_the_real_compilers_bytes_so_a_new_toolchain_is_a_miss(tmp_path):
    tools = _fake_tools(tmp_path / "tools")
    cache = _cache(tmp_path, tmp_path / "recorder")
    cached_compilers(cache, {"PATH": str(tools)}, tmp_path / "unit", tmp_path / "a", tmp_path / "s.log")
    (tools / "gcc").write_text((tools / "gcc").read_text() + "# another release\n")
    cached_compilers(cache, {"PATH": str(tools)}, tmp_path / "unit", tmp_path / "b", tmp_path / "s.log")
    assert (tmp_path / "a" / "gcc").read_text() != (tmp_path / "b" / "gcc").read_text()


def test_nvcc_and_hipcc_variables_are_hashed_with_the_units_directory_spelled_the_same_for_every_key(tmp_path):
    cache = _cache(tmp_path, tmp_path / "recorder")
    texts = []
    for key in ("0123abcd", "89ef4567"):
        unit = tmp_path / "kiln-pep517" / key
        flags = f"--objdir-as-tempdir -Xcompiler=-ffile-prefix-map={unit}/src=. -O3"
        env = cached_compilers(cache, {"PATH": "/usr/bin", "NVCC_APPEND_FLAGS": flags}, unit, tmp_path / key,
                               tmp_path / "s.log")
        texts.append(Path(env["CCACHE_EXTRAFILES"]).read_text())
    assert texts[0] == texts[1] and "-ffile-prefix-map= -O3" in texts[0]
    # the path maps name each worker's own folders (its build environments): their values are not hashed
    elsewhere = cached_compilers(cache, {"PATH": "/usr/bin", "NVCC_APPEND_FLAGS": flags.replace(
        "-O3", f"-Xcompiler=-ffile-prefix-map={tmp_path}/worker-b/envs/key=/kiln/build-env -O3")},
        tmp_path / "u2", tmp_path / "c2", tmp_path / "s.log")
    assert Path(elsewhere["CCACHE_EXTRAFILES"]).read_text() == texts[0].replace(
        "-O3", "-Xcompiler=-ffile-prefix-map= -O3")
    env = cached_compilers(cache, {"PATH": "/usr/bin", "NVCC_APPEND_FLAGS": "-O0"}, tmp_path / "u", tmp_path / "c",
                           tmp_path / "s.log")
    assert Path(env["CCACHE_EXTRAFILES"]).read_text() != texts[0]
    # hipcc's flags and its platform (amd or nvidia: another compiler behind it) are hashed with hipcc's compiles
    # only (its shim adds them), so a worker whose ROCm differs, or that has none, shares every other compile
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "hipcc").write_text("#!/bin/sh\n")
    (tools / "hipcc").chmod(0o755)
    for name, value in (("HIPCC_COMPILE_FLAGS_APPEND", "-O1"), ("HIP_PLATFORM", "nvidia")):
        env = cached_compilers(cache, {"PATH": f"{tools}:/usr/bin", "NVCC_APPEND_FLAGS": flags, name: value},
                               tmp_path / "kiln-pep517" / "0123abcd", tmp_path / name, tmp_path / "s.log")
        assert Path(env["CCACHE_EXTRAFILES"]).read_text() == texts[0], name
        hip_vars = tmp_path / name / "hipcc-vars.txt"
        assert f"{name}={value}\n" in hip_vars.read_text()
        assert f'export CCACHE_EXTRAFILES="$CCACHE_EXTRAFILES:"{hip_vars}' in (tmp_path / name / "hipcc").read_text()


def test_a_narrowing_builds_nvcc_is_not_cached_and_a_cpu_builds_hidden_nvcc_gets_no_shim(tmp_path):
    tools = _fake_tools(tmp_path / "tools")
    cache = _cache(tmp_path, tmp_path / "recorder")
    env = cached_compilers(cache, {"PATH": str(tools), "PYTORCH_NVCC": "/narrowed/nvcc"}, tmp_path / "u",
                           tmp_path / "n", tmp_path / "s.log", nvcc=False)
    assert env["PYTORCH_NVCC"] == "/narrowed/nvcc" and not (tmp_path / "n" / "nvcc").exists()
    (tools / "nvcc").unlink()
    env = cached_compilers(cache, {"PATH": str(tools)}, tmp_path / "u", tmp_path / "c", tmp_path / "s.log")
    assert "PYTORCH_NVCC" not in env and (tmp_path / "c" / "gcc").is_file()


def test_translation_units_are_the_projects_named_from_its_root_however_ccache_spelled_them(tmp_path):
    log = tmp_path / "stats.log"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ops.c").write_text("")
    log.write_text(f"# ../src/ops.c\ncache_miss\n# csrc/a.c\ncache_miss\n# ../../csrc/ops.cpp\ndirect_cache_hit\n"
                   f"# {tmp_path}/src/k/b.cu\npreprocessed_cache_hit\n# /elsewhere/c.c\ncache_miss\n")
    # /elsewhere/c.c: outside the unit's folder (ccache left it absolute), a toolchain's probe
    assert unit_stats(log, tmp_path / "src") == CompileStats(("ops.c", "csrc/a.c"), ("csrc/ops.cpp", "k/b.cu"))


@pytest.mark.skipif(os.environ.get("KILN_TEST_HEAVY_BUILDS") != "1",
                    reason="a torch C++ extension compiles for minutes on 2 cores: KILN_TEST_HEAVY_BUILDS=1")
@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_toolchain
def test_a_torch_cpp_extension_built_by_ninja_is_served_by_the_compile_cache_in_a_second_clone(tmp_path):
    pytest.importorskip("torch")
    toml = (FIXTURES / "cmulti" / "kiln.toml").read_text().replace('package = "cmulti"', 'package = "cppops"') \
        .replace('distribution = "cmulti"', 'distribution = "cpp-only-ops"').replace('version = "1.0.0"',
                                                                                   'version = "1.2.0"') \
        .replace('source = "cmulti"', 'source = "cppops"')
    wheels = []
    for number, name in enumerate(("w1", "worker-two-longer")):
        project = _clone(tmp_path / name, "cpponly")
        (project / "kiln.toml").write_text(toml)
        setup_py = project / "setup.py"  # flat layout: name the package, or setuptools refuses csrc/ beside it
        setup_py.write_text(setup_py.read_text().replace("setup(ext_modules", "setup(packages=['cppops'], ext_modules"))
        if number:
            shutil.copytree(tmp_path / "cache-0" / "ccache", tmp_path / "cache-1" / "ccache")
        result, wheel = _build(project, tmp_path / f"cache-{number}", tmp_path / f"out-{number}")
        expected = CompileStats(("csrc/ops.cpp",), ()) if number == 0 else CompileStats((), ("csrc/ops.cpp",))
        assert result.compile == expected, result.compile
        wheels.append(wheel.read_bytes())
    assert wheels[0] == wheels[1]


def test_the_compile_cache_of_a_build_is_opened_for_a_pep517_project(tmp_path):
    project = _clone(tmp_path / "p")
    setup = prepare_build(str(project / "kiln.toml"), "1.0.0", None, cache_dir=str(tmp_path / "cache"))
    assert setup.project is not None
    expected = open_compile_cache(tmp_path / "cache")
    assert setup.project.compile_cache == expected
