"""Kiln's nvcc units compile each .cu once per arch through the compile cache and combine the device code:
adding an arch to a variant compiles that arch alone, and the library is the same bytes as a build with no
cache at all, embedding exactly the planned SASS and PTX; so is the wheel. Real nvcc, ccache and cuobjdump on
one tiny .cu."""

from __future__ import annotations

import io
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from kiln.tasks.build.compile_cache import CompileStats, open_compile_cache
from kiln.tasks.build.nvcc import build_library_counted, find_nvcc
from kiln.tasks.wheel.devicecode import embedded_archs
from tests.helpers.projects import copy_project

KERNEL = """__global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
extern "C" void kiln_scale(float* x, float a, int n) { scale<<<(n + 255) / 256, 256>>>(x, a, n); }
"""

needs_toolchain = pytest.mark.skipif(shutil.which("nvcc") is None or open_compile_cache(Path("/nonexistent/x"))
                                     is None, reason="nvcc or ccache is not installed")


def _source(tmp_path: Path) -> list[Path]:
    source = tmp_path / "src" / "scale.cu"
    source.parent.mkdir(parents=True)
    source.write_text(KERNEL)
    return [source]


def _build(sources: list[Path], archs: tuple[str, ...], cache_root: Path | None) -> tuple[bytes, CompileStats]:
    cache = open_compile_cache(cache_root) if cache_root is not None else None
    return build_library_counted(find_nvcc(), sources, "libscale.so", archs, timeout=600, cache=cache)


def _archs_of(library: bytes, tmp_path: Path) -> tuple[set[str], set[str]]:
    path = tmp_path / "inspect" / "libscale.so"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(library)
    return embedded_archs(path, find_nvcc().cuobjdump)


@pytest.mark.slow
@needs_toolchain
def test_an_added_arch_compiles_alone_and_the_library_is_the_same_as_a_cold_build(tmp_path):
    sources = _source(tmp_path)
    cache = tmp_path / "cache"
    first, stats = _build(sources, ("8.0",), cache)
    assert stats == CompileStats(("scale.cu [sm_80]",), ())
    assert _archs_of(first, tmp_path) == ({"sm_80"}, set())

    # the variant gains sm_90 (with PTX): ccache's own statistics say sm_80 was served and sm_90 compiled
    warm, stats = _build(sources, ("8.0", "9.0+PTX"), cache)
    assert stats == CompileStats(("scale.cu [sm_90]",), ("scale.cu [sm_80]",))
    assert stats.describe() == "1 of 2 compilations (translation unit × arch) compiled, 1 reused"
    assert _archs_of(warm, tmp_path) == ({"sm_80", "sm_90"}, {"sm_90"})

    # the same archs with no cache at all: every arch compiled, the same bytes
    cold, stats = _build(sources, ("8.0", "9.0+PTX"), None)
    assert stats == CompileStats(("scale.cu [sm_80]", "scale.cu [sm_90]"), ())
    assert cold == warm


def _one_file_project(tmp_path: Path, name: str, archs: list[str]) -> Path:
    """The multicu fixture cut down to its scale.cu, its kernel declared for sm_80 and sm_90."""
    config = copy_project("multicu", tmp_path / name)
    registry = config.parent / "multicu" / "registry.py"
    registry.write_text(registry.read_text().replace('ARCHS = ("9.0",)', 'ARCHS = ("8.0", "9.0")')
                        .replace('SOURCES = ("csrc/scale.cu", "csrc/shift.cu", "csrc/square.cu", "csrc/api.cpp")',
                                 'SOURCES = ("csrc/scale.cu",)'))
    _set_archs(config, archs)
    return config


def _set_archs(config: Path, archs: list[str]) -> None:
    config.write_text(re.sub(r'archs = \[[^\]]*\]', "archs = " + json.dumps(archs), config.read_text(), count=1))


def _stage_build(config: Path, cache: Path, out: Path) -> tuple[CompileStats | None, bytes]:
    """The build stage's own functions (plan, unit, wheel), as the build flow calls them; the unit's compile
    statistics and the variant's wheel."""
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import UnitResult, build_unit

    setup = prepare_build(str(config), "0.1.0", None, cache_dir=str(cache))
    (unit,) = [u for u in setup.plan.units if u.kind == "nvcc"]
    with compile_context(setup, out, jobs=1) as env:
        result = build_unit(unit, env)
    assert isinstance(result, UnitResult)
    (variant,) = setup.plan.variants
    assemble_variant(setup, variant, {unit.id: result}, out)
    (wheel,) = (out / "wheels").rglob("*.whl")
    return result.compile, wheel.read_bytes()


@pytest.mark.slow
@needs_toolchain
def test_a_wheel_built_after_adding_an_arch_is_byte_identical_to_a_cold_build_of_both(tmp_path):
    config = _one_file_project(tmp_path, "a", ["8.0"])
    _stage_build(config, tmp_path / "cache-a", tmp_path / "out-a1")
    _set_archs(config, ["8.0", "9.0"])
    stats, warm = _stage_build(config, tmp_path / "cache-a", tmp_path / "out-a2")
    assert stats == CompileStats(("scale.cu [sm_90]",), ("scale.cu [sm_80]",))

    fresh = _one_file_project(tmp_path, "b", ["8.0", "9.0"])
    stats, cold = _stage_build(fresh, tmp_path / "cache-b", tmp_path / "out-b")
    assert stats == CompileStats(("scale.cu [sm_80]", "scale.cu [sm_90]"), ())
    assert warm == cold

    with zipfile.ZipFile(io.BytesIO(warm)) as wheel:
        (member,) = [n for n in wheel.namelist() if n.endswith("libmulticu.so")]
        library = wheel.read(member)
    assert _archs_of(library, tmp_path)[0] == {"sm_80", "sm_90"}
