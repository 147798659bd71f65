"""arch_policy "narrow": a build that hard-codes its own -gencode list (flash-attention's setup.py and its copies)
compiles, through Kiln's nvcc, for the variant's archs only; its wheel holds exactly them and the run says what
was dropped. Pure argument rewriting first, then real builds of the plaincuda fixture with nvcc (seconds each)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.tasks.build.compiler_shims import ACTIVE
from kiln.tasks.build.nvcc_narrow import NarrowError, narrow_args, narrowed, narrowed_cuda_home
from tests.build.test_backend import _build

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
_CAUSAL_CONV1D = ["-O3", "--use_fast_math", "-gencode", "arch=compute_75,code=sm_75", "-gencode",
                  "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90", "-gencode",
                  "arch=compute_100,code=sm_100", "-c", "csrc/conv.cu", "-o", "conv.o"]


def test_a_hard_coded_gencode_list_keeps_the_variants_archs_and_names_what_it_dropped():
    args, dropped = narrow_args(_CAUSAL_CONV1D, {"sm_90"}, set())
    assert args == ["-gencode", "arch=compute_90,code=sm_90", "-O3", "--use_fast_math", "-c", "csrc/conv.cu",
                    "-o", "conv.o"]
    assert dropped == ["sm_100", "sm_75", "sm_80"]


@pytest.mark.parametrize(("flags", "ptx", "kept", "dropped"), [
    (["-gencode=arch=compute_90,code=[sm_90,compute_90]"], set(), "arch=compute_90,code=sm_90", ["compute_90"]),
    (["--generate-code", "arch=compute_90,code=\"sm_90,compute_90\""], {"sm_90"},
     "arch=compute_90,code=[sm_90,compute_90]", []),
    (["-arch=sm_90"], set(), "arch=compute_90,code=sm_90", ["compute_90"]),  # -arch=sm_90 alone: SASS and PTX
    (["-arch", "compute_80", "-code", "sm_80,sm_90"], set(), "arch=compute_80,code=sm_90", ["sm_80"]),
    (["-gencode", "arch=compute_90a,code=sm_90a"], set(), None, None),  # sm_90a is not sm_90: refused below
])
def test_every_spelling_of_an_nvcc_target_is_read(flags, ptx, kept, dropped):
    if kept is None:
        with pytest.raises(NarrowError, match=r"asks nvcc for \['sm_90a'\], none of them the variant's \['sm_90'\]"):
            narrow_args([*flags, "-c", "a.cu"], {"sm_90"}, ptx)
        return
    assert narrow_args([*flags, "-c", "a.cu"], {"sm_90"}, ptx) == (["-gencode", kept, "-c", "a.cu"], dropped)


def test_commands_that_name_no_target_pass_unchanged_and_unnarrowable_ones_are_refused():
    assert narrow_args(["-V"], {"sm_90"}, set()) == (["-V"], [])
    assert narrow_args(["-dryrun", "-c", "e.cu"], {"sm_90"}, set()) == (["-dryrun", "-c", "e.cu"], [])
    for flags in (["-arch=native"], ["-arch", "all-major"], ["-code=sm_90"]):
        with pytest.raises(NarrowError, match="cannot narrow"):
            narrow_args([*flags, "-c", "a.cu"], {"sm_90"}, set())


def _recorder(path: Path, name: str, log: Path, then: str) -> Path:
    """A script that appends ``name`` and its arguments to ``log`` as a JSON line, then runs ``then``."""
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n{then}\n")
    path.chmod(0o755)
    return path


def test_the_narrowing_nvcc_runs_the_compile_cache_with_the_real_nvcc_and_records_every_compile(tmp_path):
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    real = _recorder(tmp_path / "cuda" / "bin" / "nvcc", "nvcc", calls, "")
    # a stand-in for ccache (fault-free, named as such): it records its command, then runs the compiler it is given
    launcher = _recorder(tmp_path / "ccache", "ccache", calls, "os.execv(sys.argv[1], sys.argv[1:])")
    home = narrowed_cuda_home(tmp_path / "cuda", tmp_path / "narrow", {"sm_90"}, set(), sys.executable,
                              (str(launcher), ACTIVE))
    env = {k: v for k, v in os.environ.items() if k != ACTIVE}
    for active in (None, "1"):  # a compile, then one nested below a compile-cache shim
        run = subprocess.run([str(home / "bin" / "nvcc"), *_CAUSAL_CONV1D], env=env | ({ACTIVE: active} if active
                             else {}), capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
    narrowed_flags = ["-gencode", "arch=compute_90,code=sm_90", "-O3", "--use_fast_math", "-c", "csrc/conv.cu",
                      "-o", "conv.o"]
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        ["ccache", str(real.resolve()), *narrowed_flags], ["nvcc", *narrowed_flags],  # through the cache, once
        ["nvcc", *narrowed_flags]]  # nested: the real nvcc directly
    assert [n["dropped"] for n in narrowed(home)] == [["sm_100", "sm_75", "sm_80"]] * 2  # both compiles recorded


# The plaincuda fixture, its setup.py edited to name its own four archs through $CUDA_HOME/bin/nvcc (as torch's
# cpp_extension does), whatever Kiln exports; its cu130 variant asks for 8.0 and 9.0.
_OWN_ARCHS = '''
import os, subprocess
from pathlib import Path
from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

FLAGS = []
for number in ("75", "80", "90", "100"):
    FLAGS += ["-gencode", f"arch=compute_{number},code=sm_{number}"]


class BuildWithCuda(build_py):
    def run(self):
        super().run()
        if os.environ.get("KILN_BACKEND") == "cuda":
            nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
            out = Path(self.build_lib) / "plaincuda" / "libfill.so"
            subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", str(out), "csrc/fill.cu", *FLAGS],
                           check=True, timeout=600)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return os.environ.get("KILN_BACKEND") == "cuda"


setup(cmdclass={"build_py": BuildWithCuda}, distclass=BinaryDistribution)
'''


def _own_archs(policy: str, archs: str = '["8.0", "9.0"]'):
    def edit(repo: Path) -> None:
        (repo / "setup.py").write_text(_OWN_ARCHS)
        config = repo / "kiln.toml"
        config.write_text(config.read_text().replace('archs = ["8.0", "9.0"]',
                                                     f'archs = {archs}\narch_policy = "{policy}"'))
    return edit


@needs_nvcc
def test_narrow_builds_a_hard_coded_gencode_list_for_the_variants_archs_only(prefect_server, tmp_path):
    from kiln.tasks.build.nvcc import find_cuobjdump
    from kiln.tasks.wheel.devicecode import wheel_contents

    state, units, run = _build(tmp_path, _own_archs("narrow"))
    assert state.is_completed(), state.message
    unit = units["build/cu130/sm_80+sm_90/plaincuda/pep517"]
    assert "(narrow); Kiln's nvcc dropped its build's own targets ['sm_100', 'sm_75']" in unit.message, unit.message
    wheels = {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}
    contents = wheel_contents(wheels["cu130"], find_cuobjdump())
    assert {n: (c.sass, c.ptx) for n, c in contents.items()} == {"plaincuda/libfill.so": ({"sm_80", "sm_90"}, set())}


@needs_nvcc
def test_the_same_build_under_exact_is_refused_and_narrow_refuses_archs_the_build_never_names(
        prefect_server, tmp_path):
    state, units, _ = _build(tmp_path / "exact", _own_archs("exact"))
    assert state.is_failed()
    message = units["build/cu130/sm_80+sm_90/plaincuda/pep517"].message
    assert "arch_policy 'exact'" in message and "extra SASS ['sm_100', 'sm_75']" in message, message
    state, units, _ = _build(tmp_path / "narrow", _own_archs("narrow", '["12.0"]'))
    assert state.is_failed()
    message = units["build/cu130/sm_120/plaincuda/pep517"].message
    assert ("under arch_policy \"narrow\" failed: the build asks nvcc for ['sm_100', 'sm_75', 'sm_80', 'sm_90'], none of"
            " them the variant's ['sm_120']") in message, message
