"""A package's own nvcc build when its variant gains an arch: Kiln's nvcc compiles the new arch alone.

The project is tests/fixtures/projects/plaincuda with its setup.py compiling ``csrc/fill.cu`` (``nvcc -c`` with
the variant's ``-gencode`` list) and then linking, as a setuptools package that calls nvcc itself does; the ``.cu``
grown by ``--kernels`` generated kernels so device code is most of a compile. Its cu130 unit is built by the build
stage's own functions (plan, unit, its sandboxed ``pip wheel``). Each repeat, in fresh directories:

- ``cold``: the variant at ``["8.0", "9.0", "10.0"]``, empty caches (the baseline);
- ``add_arch``: another clone built at ``["8.0", "9.0"]`` first (not timed), then at ``["8.0", "9.0", "10.0"]``:
  Kiln's nvcc serves sm_80 and sm_90 from the compile cache and compiles sm_100;
- ``add_arch_whole_call``: the same, with nvcc's shim running the whole ``-gencode`` list as one cached call (what
  a package build did before Kiln's nvcc split it): the wider list is a new key, every arch compiles again.

Usage::

    python benchmarks/bench_pep517_add_arch.py [--repeats 3] [--kernels 120]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "projects" / "plaincuda"
NARROW, WIDE = '["8.0", "9.0"]', '["8.0", "9.0", "10.0"]'
_ONE_CALL = ('subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-o", str(out), "csrc/fill.cu", '
             '*gencode(archs)],\n                           check=True, timeout=600)')
_COMPILE_THEN_LINK = (
    'obj = Path(self.build_lib).parent / "fill.o"\n            subprocess.run(["nvcc", "-c", "-Xcompiler", "-fPIC", '
    '"-o", str(obj), "csrc/fill.cu", *gencode(archs)], check=True, timeout=600)\n            subprocess.run(["nvcc",'
    ' "-shared", "-o", str(out), str(obj), *gencode(archs)], check=True, timeout=600)')


def project(dest: Path, kernels: int, archs: str) -> Path:
    """plaincuda compiling then linking, its .cu grown by ``kernels`` kernels, one CUDA variant of ``archs``."""
    if not dest.exists():
        shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
        setup_py = dest / "setup.py"
        if _ONE_CALL not in setup_py.read_text():
            raise SystemExit("plaincuda's setup.py changed: update this benchmark")
        setup_py.write_text(setup_py.read_text().replace(_ONE_CALL, _COMPILE_THEN_LINK))
        body = "".join(
            f"__global__ void grown_{i}(float* o, const float* a, int n) {{\n"
            f"  int t = blockIdx.x * blockDim.x + threadIdx.x; float s = {i}.0f;\n"
            f"  for (int k = 0; k < {8 + i % 8}; ++k) s = fmaf(s, a[(t + k) % n], {i % 5}.5f) / (1.0f + s * s);\n"
            f"  if (t < n) o[t] = s;\n}}\n" for i in range(kernels))
        (dest / "csrc" / "fill.cu").write_text((dest / "csrc" / "fill.cu").read_text() + body)
    config = dest / "kiln.toml"
    config.write_text(re.sub(r"archs = \[[^]]*\]", f"archs = {archs}", config.read_text(), count=1)
                      .replace('[[variants]]\nname = "cpu"\nbackend = "cpu"\n', ""))
    return dest


def build(dest: Path, cache: Path, out: Path) -> dict:
    """One build of the project's CUDA unit: its wall time and the compilations it ran and reused."""
    from kiln.tasks.build.stage import compile_context, prepare_build
    from kiln.tasks.build.units import build_unit

    start = time.perf_counter()
    setup = prepare_build(str(dest / "kiln.toml"), "1.0.0", None, cache_dir=str(cache))
    (unit,) = setup.plan.units
    with compile_context(setup, out) as context:
        result = build_unit(unit, context)
    stats = result.compile
    return {"s": time.perf_counter() - start, "compiled": list(stats.compiled) if stats else None,
            "reused": list(stats.reused) if stats else None}


def add_arch(root: Path, kernels: int, name: str) -> dict:
    clone = project(root / name, kernels, NARROW)
    build(clone, root / f"cache-{name}", root / f"out-{name}-1")
    return build(project(clone, kernels, WIDE), root / f"cache-{name}", root / f"out-{name}-2")


def repeat(root: Path, kernels: int) -> dict[str, dict]:
    from kiln.tasks.build import backend

    results = {"cold": build(project(root / "cold", kernels, WIDE), root / "cache-cold", root / "out-cold"),
               "add_arch": add_arch(root, kernels, "split")}
    whole_call = backend.cached_compilers

    def unsplit(*args, **kwargs):  # the baseline: nvcc's shim as before Kiln's nvcc (the whole call cached)
        return whole_call(*args, **(kwargs | {"cuobjdump": None}))

    with mock.patch.object(backend, "cached_compilers", unsplit):
        results["add_arch_whole_call"] = add_arch(root, kernels, "whole")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", type=int, default=120, help="generated kernels added to fill.cu")
    args = parser.parse_args()
    from benchmarks.bench_compile_cache_pep517 import medians, repeated

    runs = repeated(repeat, args.repeats, args.kernels, "kiln-bench-addarch-")
    summary = medians(runs, {"machine": f"{platform.node()} {platform.machine()}", "repeats": args.repeats,
                             "kernels": args.kernels})
    summary["compilations"] = {name: {"compiled": runs[-1][name]["compiled"], "reused": runs[-1][name]["reused"]}
                               for name in runs[0]}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
