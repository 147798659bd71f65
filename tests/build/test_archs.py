"""Arch resolution: requested archs ∩ a kernel's supported archs, one rule per row."""

from __future__ import annotations

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.project.archs import resolve, resolve_cuda, resolve_rocm, skip_reason


def _pairs(resolved):
    return [(r.requested, r.arch, r.rule) for r in resolved]


@pytest.mark.parametrize(
    ("requested", "supported", "expected"),
    [
        # exact match
        (["8.0", "9.0"], ["8.0", "9.0"], [("8.0", "8.0", "exact"), ("9.0", "9.0", "exact")]),
        # highest supported arch of the same major at or below the target
        (["8.6"], ["8.0", "8.6", "8.9"], [("8.6", "8.6", "exact")]),
        (["8.7"], ["8.0", "8.6", "8.9"], [("8.7", "8.6", "lower-minor")]),
        (["8.9"], ["8.0"], [("8.9", "8.0", "lower-minor")]),
        # never across majors, never upward
        (["9.0"], ["8.0", "8.9"], []),
        (["8.0"], ["8.6"], []),
        # a/f archs only when their base arch is requested
        (["9.0"], ["9.0a"], [("9.0", "9.0a", "suffix")]),
        (["10.0"], ["10.0f"], [("10.0", "10.0f", "suffix")]),
        (["10.3"], ["10.0f"], []),
        (["9.0a"], ["9.0a"], [("9.0a", "9.0a", "exact")]),
        (["9.0a"], ["9.0"], [("9.0a", "9.0", "lower-minor")]),
        # +PTX: requested PTX carries over; a supported PTX entry covers newer archs
        (["12.0+PTX"], ["12.0"], [("12.0+PTX", "12.0+PTX", "exact")]),
        (["12.0"], ["8.0+PTX"], [("12.0", "8.0+PTX", "ptx")]),
        (["12.0"], ["8.0"], []),
        # two targets that resolve to the same arch build it once
        (["8.6", "8.9"], ["8.0"], [("8.6", "8.0", "lower-minor")]),
        # the default cu130 matrix against a kernel without 10.0
        (["8.0", "9.0", "10.0", "12.0"], ["8.0", "9.0", "12.0"],
         [("8.0", "8.0", "exact"), ("9.0", "9.0", "exact"), ("12.0", "12.0", "exact")]),
    ],
)
def test_cuda_loose_intersection(requested, supported, expected):
    assert _pairs(resolve_cuda(requested, supported)) == expected


@pytest.mark.parametrize(
    ("requested", "supported", "expected"),
    [
        (["gfx90a", "gfx942"], ["gfx942", "gfx950"], [("gfx942", "gfx942", "exact")]),
        (["gfx942"], ["gfx940"], []),  # gfx names match exactly, no "nearest"
        (["gfx90a"], ["gfx90a"], [("gfx90a", "gfx90a", "exact")]),
    ],
)
def test_rocm_matches_exactly(requested, supported, expected):
    assert _pairs(resolve_rocm(requested, supported)) == expected


@pytest.mark.parametrize(
    ("backend", "requested", "supported", "needle"),
    [
        ("cuda", ["native"], ["8.0"], "'native' is refused"),
        ("cuda", ["8.0"], ["sm_80"], "unknown CUDA arch 'sm_80'"),
        ("cuda", ["90"], ["9.0"], "unknown CUDA arch '90'"),
        ("hip", ["native"], ["gfx942"], "'native' is refused"),
        ("hip", ["mi300"], ["gfx942"], "unknown ROCm arch 'mi300'"),
        ("cpu", [], [], "has no archs"),
    ],
)
def test_unknown_arch_names_are_errors(backend, requested, supported, needle):
    with pytest.raises(InvalidInputError, match=needle):
        resolve(backend, requested, supported)


def test_skip_reason_names_kernel_requested_and_supported():
    reason = skip_reason("fp8_gemm", "cuda", ["8.0", "9.0"], ["10.0"])
    assert "'fp8_gemm'" in reason and "['8.0', '9.0']" in reason and "['10.0']" in reason
