"""Kiln's nvcc units compile each .cu once per arch through the compile cache and combine the device code:
adding an arch to a variant compiles that arch alone, and the library is the same bytes as a build with no
cache at all, embedding exactly the planned SASS and PTX. Real nvcc, ccache and cuobjdump on one tiny .cu."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.tasks.build.compile_cache import CompileStats, open_compile_cache
from kiln.tasks.build.nvcc import build_library_counted, embedded_archs, find_nvcc

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
