"""Planning the matrix variant × kernel × specialization × arch, with skips."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConfigError
from kiln.runtime.spec import CudaSource, KernelSpec, Specialization, TritonEntry
from kiln.tasks.build.plan import plan_build
from kiln.tasks.project.registry import load_registry, read_registry

TOOLS = {"triton": "3.9.0", "torch": "2.13.0"}


def _special(name, **fields):
    return Specialization(name, {"x": "*fp32"}, **fields)


def _fn():
    """A stand-in for a JIT function; planning never calls it."""


def _kernel(config, name, supported, *specs, csrc=None):
    """One kernel as the planner gets it: a spec, validated into Kiln's record."""
    triton = (TritonEntry(f"{name}_kernel", _fn, tuple(specs)),) if specs else ()
    (record,) = read_registry(config, [KernelSpec(name, "tinyk.add", supported, triton, csrc)])
    return record


def _ids(plan):
    return sorted(u.id for u in plan.units)


def test_tiny_project_plan_has_units_and_a_skip_with_reason(tiny_config):
    plan = plan_build(tiny_config, load_registry(tiny_config), TOOLS)
    assert _ids(plan) == [
        "build/cu130/8.0/add/fp32_b64", "build/cu130/8.0/scale/fp32_b64",
        "build/cu130/9.0/add/fp32_b64", "build/rocm/gfx942/add/fp32_b64",
    ]
    skips = {s.id: s for s in plan.skips}
    assert sorted(skips) == ["build/cu130/9.0/scale/triton", "build/rocm/-/scale/-"]
    skip = skips["build/rocm/-/scale/-"]
    assert skip.variant == "rocm" and skip.kernel == "scale"
    assert "['gfx942']" in skip.reason and "supported archs []" in skip.reason
    # An arch the kernel does not support is recorded as a skip, never silently dropped.
    dropped = skips["build/cu130/9.0/scale/triton"]
    assert dropped.arch == "9.0" and "does not support cuda arch 9.0" in dropped.reason and "['8.0']" in dropped.reason
    assert [v.name for v in plan.variants] == ["cu130", "rocm", "cpu"]
    assert plan.variants[2].units == () and plan.variants[2].skips == ()


def test_specialization_backends_and_min_arch_become_skips(tiny_config):
    kernel = _kernel(tiny_config, "q", {"cuda": ("8.0", "9.0"), "hip": ("gfx942",)},
                     _special("i8"), _special("fp8", min_arch={"cuda": "8.9"}), _special("cuda_only", backends=("cuda",)))
    plan = plan_build(tiny_config, [kernel], TOOLS)
    assert _ids(plan) == [
        "build/cu130/8.0/q/cuda_only", "build/cu130/8.0/q/i8",
        "build/cu130/9.0/q/cuda_only", "build/cu130/9.0/q/fp8", "build/cu130/9.0/q/i8",
        "build/rocm/gfx942/q/fp8", "build/rocm/gfx942/q/i8",
    ]
    reasons = {s.id: s.reason for s in plan.skips}
    assert "needs cuda arch >= 8.9" in reasons["build/cu130/8.0/q/fp8"]
    assert "only for ['cuda']" in reasons["build/rocm/gfx942/q/cuda_only"]


def test_variant_filter_and_unknown_variant(tiny_config):
    specs = load_registry(tiny_config)
    plan = plan_build(tiny_config, specs, TOOLS, variants=["rocm"])
    assert _ids(plan) == ["build/rocm/gfx942/add/fp32_b64"]
    with pytest.raises(ConfigError, match="unknown variant 'cu999'"):
        plan_build(tiny_config, specs, TOOLS, variants=["cu999"])


def test_nvcc_unit_gets_exactly_the_filtered_archs(tiny_config):
    kernel = _kernel(tiny_config, "act", {"cuda": ("8.0",)}, csrc=CudaSource("csrc", ("add.py",), ("7.5", "8.0", "8.6"), "libx.so"))
    plan = plan_build(tiny_config, [kernel], TOOLS)
    (unit,) = plan.units
    assert unit.kind == "nvcc" and unit.archs == ("8.0",)  # 9.0 is not covered by 7.5/8.0/8.6
    assert unit.id == "build/cu130/sm_80/act/csrc"
    (skip,) = plan.skips
    assert skip.id == "build/cu130/9.0/act/csrc" and "does not support cuda arch 9.0" in skip.reason


def test_the_long_units_start_first_and_the_rest_keep_plan_order(tiny_config):
    csrc = CudaSource("csrc", ("add.py",), ("8.0",), "libx.so")
    kernels = [_kernel(tiny_config, name, {"cuda": ("8.0", "9.0")}, _special("s"), _special("t"), csrc=csrc)
               for name in ("act", "norm")]
    plan = plan_build(tiny_config, kernels, TOOLS)
    planned, started = plan.units, plan.in_start_order()
    assert [u.kind for u in planned].index("nvcc") > 0  # the plan lists each after its kernel's Triton units
    assert [u.kind for u in started] == ["nvcc", "nvcc"] + ["triton"] * (len(planned) - 2)
    assert [u.id for u in started[2:]] == [u.id for u in planned if u.kind == "triton"]
    assert sorted(u.id for u in started) == sorted(u.id for u in planned)  # nothing lost or repeated


def test_missing_nvcc_skips_cuda_cpp_units_with_the_reason(tiny_config):
    kernel = _kernel(tiny_config, "act", {"cuda": ("8.0",)}, _special("s"), csrc=CudaSource("csrc", ("add.py",), ("8.0",), "libx.so"))
    plan = plan_build(tiny_config, [kernel], TOOLS, nvcc_missing="CUDA C++ units skipped: nvcc not found")
    assert [u.kind for u in plan.units] == ["triton"]  # Triton units still build
    (skip,) = [s for s in plan.skips if s.id.endswith("/act/csrc")]
    assert skip.reason == "CUDA C++ units skipped: nvcc not found"


def test_keys_change_with_source_target_and_toolchain(tiny_config):
    specs = load_registry(tiny_config)
    base = {u.id: u.key for u in plan_build(tiny_config, specs, TOOLS).units}
    assert len(set(base.values())) == len(base)  # every unit has its own key
    other = {u.id: u.key for u in plan_build(tiny_config, specs, {**TOOLS, "triton": "3.10"}).units}
    assert not set(base.values()) & set(other.values())
    add = tiny_config.path("tinyk/add.py")
    add.write_text(add.read_text() + "\n# edited\n")
    edited = {u.id: u.key for u in plan_build(tiny_config, specs, TOOLS).units}
    changed = sorted(uid for uid in base if base[uid] != edited[uid])
    assert changed == ["build/cu130/8.0/add/fp32_b64", "build/cu130/9.0/add/fp32_b64", "build/rocm/gfx942/add/fp32_b64"]
