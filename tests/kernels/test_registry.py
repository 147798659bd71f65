"""The registry is the pipeline's only view of the kernels: it must describe
exactly what the op wrappers launch, and every specialization must compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln_kernels
from kiln_kernels import decode, quant, registry, router
from kiln_kernels.registry import BenchCase, KernelSpec

PKG = Path(kiln_kernels.__file__).parent


@pytest.fixture(scope="module")
def specs() -> dict[str, KernelSpec]:
    return {s.name: s for s in registry.registry()}


def test_four_kernels(specs):
    assert set(specs) == {"per_token_quant", "router_logits", "gated_delta_decode", "silu_and_mul"}
    assert specs["silu_and_mul"].csrc is not None and not specs["silu_and_mul"].triton


def test_signatures_name_every_parameter(specs):
    for spec in specs.values():
        for entry in spec.triton:
            names = [s.name for s in entry.specializations]
            assert len(names) == len(set(names)), f"{spec.name}: duplicate specialization names"
            for s in entry.specializations:
                assert list(s.signature) == list(entry.fn.arg_names), s.name
                consts = [p for p, t in s.signature.items() if t == "constexpr"]
                assert sorted(consts) == sorted(s.constexprs), s.name
                assert all(s.signature[p] != "constexpr" for p in s.aligned), s.name


def test_fp8_specializations_need_sm89_or_gfx942(specs):
    fp8 = [s for s in specs["per_token_quant"].triton[0].specializations if "fp8" in s.name]
    assert fp8
    for s in fp8:
        assert not registry.targets_for(s, "cuda", "8.0") and registry.targets_for(s, "cuda", "8.9")
        assert registry.targets_for(s, "cuda", "12.0")
        assert not registry.targets_for(s, "hip", "gfx90a") and registry.targets_for(s, "hip", "gfx942")


def test_every_launch_configuration_has_a_specialization():
    names = []
    for dt in quant.IN_DTYPES:
        for out in quant.QMAX:
            names += [("per_token_quant", "per_token_quant_kernel", quant.spec_name(dt, out, quant.block_for(n)))
                      for n in (1, 512, 513, 8192)]
        names += [("gated_delta_decode", "gated_delta_decode_kernel", decode.spec_name(dt, decode.config_for(k)))
                  for k in (1, 64, 65, 128)]
    names += [("router_logits", "router_logits_kernel", router.spec_name(router.config_for(t))) for t in (1, 17)]
    for kernel, entry, name in names:
        spec, fn = registry.find_specialization(kernel, entry, name)
        assert spec.name == name and fn is not None


def test_csrc_sources_exist_and_archs_are_cuda(specs):
    csrc = specs["silu_and_mul"].csrc
    for src in csrc.sources:
        assert (PKG / src).is_file(), src
    assert set(specs["silu_and_mul"].supported) == {"cuda"}
    assert set(csrc.supported) == set(specs["silu_and_mul"].supported["cuda"])


def test_supported_archs_are_well_formed(specs):
    for spec in specs.values():
        for arch in spec.supported.get("cuda", ()):
            kiln_kernels.platform.cuda_arch_key(arch)
        assert all(a.startswith("gfx") for a in spec.supported.get("hip", ()))


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


SMALL_CASE_BYTES = 64 * 1024


@pytest.mark.parametrize("kernel", ["per_token_quant", "router_logits", "gated_delta_decode", "silu_and_mul"])
def test_small_bench_cases_are_small_and_match_reference(kernel, specs, device):
    cases = specs[kernel].bench_cases("small")
    assert cases and all(isinstance(c, BenchCase) and c.bytes > 0 for c in cases)
    for case in cases:
        # "small" is what the Triton interpreter runs in CI: sized by the bytes it moves, not by a wall-clock
        # guess that a loaded machine breaks (the large sweep moves tens of MB to GB)
        assert case.bytes <= SMALL_CASE_BYTES, f"{case.name} moves {case.bytes} bytes"
        inputs = case.make_inputs(device)
        ref_inputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        got = _outputs(case.fn(*inputs))
        want = _outputs(case.reference(*ref_inputs))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)  # int8 codes may differ by 1


def test_large_bench_cases_are_declared_without_building_inputs(specs):
    for spec in specs.values():
        cases = spec.bench_cases("large")
        assert cases and all(c.flops > 0 and c.bytes > 0 for c in cases)
    with pytest.raises(ValueError, match="small"):
        specs["router_logits"].bench_cases("medium")


@pytest.mark.slow
def test_every_specialization_compiles_for_sm90_and_gfx942():
    """Ahead of time, no GPU: cubin for sm_90, hsaco for gfx942 (~30 s)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_kernels.compile_all", "--target", "cuda:9.0", "--target", "hip:gfx942"],
        cwd=PKG.parent, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = sum(len(e.specializations) for s in registry.registry() for e in s.triton) * 2
    assert f"{expected} compiles" in proc.stdout


def test_registry_functions_compile_even_in_an_interpreter_process():
    """Build-stage code calls triton.compile on entry.fn directly; that must
    work in a process where TRITON_INTERPRET=1 was set first."""
    from triton.runtime.jit import JITFunction

    for spec in registry.registry():
        for entry in spec.triton:
            assert type(entry.fn) is JITFunction, entry.name


def test_kernel_imported_without_interpreter_gives_a_clear_error_in_interpreter_mode():
    """The interpreter cannot run a kernel whose module was imported in JIT
    mode; say what to do instead of Triton's opaque message."""
    from kiln_kernels import _launch, _quant_tl, aot

    jit_fn = aot.jit_function(_quant_tl.per_token_quant_kernel)
    with pytest.raises(kiln_kernels.KernelUnavailableError, match="TRITON_INTERPRET=1 was set after"):
        _launch.runnable(jit_fn, interpreter=True)


def test_kernel_imported_in_interpreter_mode_is_rebuilt_for_the_jit():
    from triton.runtime.jit import JITFunction

    from kiln_kernels import _launch, _quant_tl

    fn = _launch.runnable(_quant_tl.per_token_quant_kernel, interpreter=False)
    assert type(fn) is JITFunction and fn.fn is _quant_tl.per_token_quant_kernel.fn


def _qualified(fn):
    inner = getattr(fn, "fn", fn)  # a JITFunction wraps the Python function
    return f"{inner.__module__}.{inner.__qualname__}"


def test_kilns_loader_accepts_the_registry_and_copies_every_specialization(specs):
    """What the pipeline reads is exactly this registry, through Kiln's validation."""
    from kiln.tasks.bench.harness import kernel_cases
    from kiln.tasks.project.config import load_config
    from kiln.tasks.project.registry import load_registry

    # The project's kiln.toml beside these tests: the package under test may be an installed wheel.
    records = {r.name: r for r in load_registry(load_config(Path(__file__).resolve().parents[2] / "kiln.toml"))}
    assert list(records) == list(specs)
    for name, spec in specs.items():
        record = records[name]
        assert [(e.name, [s.name for s in e.specializations]) for e in record.triton] == \
               [(e.name, [s.name for s in e.specializations]) for e in spec.triton]
        # the same jit functions, by name: under an installed wheel the registry is loaded from the source tree
        assert [_qualified(e.fn) for e in record.triton] == [_qualified(e.fn) for e in spec.triton]
        assert (record.csrc is None) == (spec.csrc is None)
        assert [c.name for c in kernel_cases(record, "large")] == [c.name for c in spec.bench_cases("large")]
