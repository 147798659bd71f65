"""kiln.runtime.archs: the one "arch X is at least arch Y" rule, used at build time and at run time."""

from __future__ import annotations

import itertools

import pytest

from kiln.core.errors import InvalidInputError
from kiln.runtime.archs import arch_key, at_least, cuda_arch_key, gfx_version
from kiln.tasks.build.plan import _below_min
from kiln_kernels.platform import Platform
from kiln_kernels.registry import Specialization, targets_for


@pytest.mark.parametrize(("arch", "version"), [
    ("gfx906", (9, 0, 6)), ("gfx908", (9, 0, 8)), ("gfx90a", (9, 0, 10)), ("gfx942", (9, 4, 2)),
    ("gfx950", (9, 5, 0)), ("gfx1030", (10, 3, 0)), ("gfx1100", (11, 0, 0)), ("gfx1151", (11, 5, 1)),
    ("gfx1200", (12, 0, 0)), ("gfx1201", (12, 0, 1)),
])
def test_gfx_names_decode_to_major_minor_stepping(arch, version):
    assert gfx_version(arch) == version


@pytest.mark.parametrize(("arch", "key"), [
    ("8.0", (8, 0)), ("9.0a", (9, 0)), ("10.0f", (10, 0)), ("12.0+PTX", (12, 0)), ("12", (12, 0)), ("10.3", (10, 3)),
])
def test_cuda_arch_key_ignores_suffix_and_ptx(arch, key):
    assert cuda_arch_key(arch) == key


GFX_ORDER = ["gfx906", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1030", "gfx1100", "gfx1151", "gfx1200", "gfx1201"]
CUDA_ORDER = ["7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "10.3", "12.0"]


@pytest.mark.parametrize(("backend", "order"), [("hip", GFX_ORDER), ("cuda", CUDA_ORDER)])
def test_archs_sort_in_generation_order(backend, order):
    shuffled = order[1::2] + order[::2]
    assert sorted(shuffled, key=lambda a: arch_key(backend, a)) == order


@pytest.mark.parametrize(("backend", "arch", "minimum", "expected"), [
    ("hip", "gfx90a", "gfx942", False),
    ("hip", "gfx942", "gfx942", True),
    ("hip", "gfx950", "gfx942", True),
    ("hip", "gfx1100", "gfx950", True),
    ("hip", "gfx1151", "gfx1100", True),
    ("hip", "gfx1100", "gfx1151", False),
    ("hip", "gfx942", "gfx90a", True),
    ("hip", "gfx908", "gfx90a", False),  # 9.0.8 < 9.0.10: the stepping is a hex digit, not a letter
    ("hip", "gfx1200", "gfx1151", True),
    ("cuda", "8.0", "8.9", False),
    ("cuda", "8.9", "8.9", True),
    ("cuda", "9.0a", "9.0", True),
    ("cuda", "9.0", "9.0a", True),  # a suffix does not change the order
    ("cuda", "12.0+PTX", "10.0", True),
    ("cuda", "10.0", "12.0", False),
])
def test_at_least(backend, arch, minimum, expected):
    assert at_least(backend, arch, minimum) is expected


@pytest.mark.parametrize(("backend", "arch"), [
    ("hip", "gfx94"), ("hip", "sm_90"), ("hip", "9.0"), ("hip", "gfx942:xnack-"),
    ("cuda", "gfx942"), ("cuda", "sm_90"), ("cuda", "9.x"), ("cpu", "x86"),
])
def test_names_that_are_not_archs_of_the_backend_are_value_errors(backend, arch):
    with pytest.raises(ValueError, match=repr(arch) if backend != "cpu" else "backend 'cpu'"):
        arch_key(backend, arch)


PAIRS = [("hip", a, m) for a, m in itertools.product(GFX_ORDER, ["gfx90a", "gfx942", "gfx1100"])] + \
        [("cuda", a, m) for a, m in itertools.product(CUDA_ORDER, ["8.0", "8.9", "10.0"])]


@pytest.mark.parametrize(("backend", "arch", "minimum"), PAIRS)
def test_build_plan_and_kernel_registry_apply_the_same_rule(backend, arch, minimum):
    """A specialization is built for an arch exactly when the kernel package would pick it there."""
    spec = Specialization(name="s", signature={}, min_arch={backend: minimum})
    assert (not _below_min(backend, arch, minimum)) is targets_for(spec, backend, arch) is at_least(backend, arch, minimum)


def test_platform_gates_use_the_rule_on_supported_archs_only():
    assert Platform("hip", "gfx950").hip_at_least("gfx942")
    assert not Platform("hip", "gfx90a").hip_at_least("gfx942")
    assert not Platform("hip", "gfx1100").hip_at_least("gfx942")  # RDNA is not a supported target
    assert Platform("cuda", "12.0").cuda_at_least("8.9") and not Platform("cuda", "8.6").cuda_at_least("8.9")


def test_a_malformed_min_arch_is_a_clear_input_error_at_plan_time():
    with pytest.raises(InvalidInputError, match="unknown ROCm arch 'gfx94'"):
        _below_min("hip", "gfx942", "gfx94")
