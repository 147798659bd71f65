"""A variant's arch_policy (exact, at_least, record) and a GPU wheel with no device code at all."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kiln.core.errors import CompileError
from kiln.tasks.build.backend import device_code_json
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from kiln.tasks.wheel.devicecode import check_wheel, held

_BUNDLE = b"__CLANG_OFFLOAD_BUNDLE__"


def _bundle(*targets: str) -> bytes:
    ids = [f"hipv4-amdgcn-amd-amdhsa--{t}" for t in targets]
    entries = b"".join(struct.pack("<QQQ", 0, 0, len(i)) + i.encode() for i in ids)
    return b"\x7fELF host code" + _BUNDLE + struct.pack("<Q", len(ids)) + entries + b"code objects"


def _wheel(tmp_path: Path, files: dict[str, bytes]) -> Path:
    members = {**files, "pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
               "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: false\nTag: py3-none-any\n"}
    return write_wheel(tmp_path, "pkg-1.0-py3-none-any.whl", sorted(members.items()), WheelStamp())


@pytest.fixture
def more_archs(tmp_path: Path) -> Path:
    """A package that picks its own archs: it holds the asked-for gfx942 and an extra gfx1100."""
    return _wheel(tmp_path, {"pkg/libops.so": _bundle("gfx942", "gfx1100")})


def test_exact_refuses_archs_the_variant_did_not_ask_for(more_archs):
    with pytest.raises(CompileError, match=r"(?s)variant rocm: .*arch_policy 'exact'.*extra ROCm \['gfx1100'\]"):
        check_wheel(more_archs, "hip", ("gfx942",), None, variant="rocm")


def test_at_least_accepts_extra_archs_but_not_a_missing_one(more_archs):
    found = check_wheel(more_archs, "hip", ("gfx942",), None, policy="at_least", variant="rocm")
    assert held(found).gfx == {"gfx942", "gfx1100"}
    with pytest.raises(CompileError, match=r"missing ROCm \['gfx90a'\]") as caught:
        check_wheel(more_archs, "hip", ("gfx90a", "gfx942"), None, policy="at_least", variant="rocm")
    assert "extra" not in str(caught.value)


def test_record_accepts_whatever_the_wheel_holds_and_records_it(more_archs):
    found = check_wheel(more_archs, "hip", ("gfx90a",), None, policy="record", variant="rocm")
    record = json.loads(device_code_json(found, "record"))
    assert record["gfx"] == ["gfx1100", "gfx942"] and record["policy"] == "record"
    assert record["held"] == "ROCm ['gfx1100', 'gfx942']"


@pytest.mark.parametrize("policy", ["exact", "at_least", "record"])
def test_a_gpu_wheel_with_no_shared_library_fails_naming_the_variant(tmp_path, policy):
    wheel = _wheel(tmp_path, {"pkg/__init__.py": b"def jit(): ...\n"})
    with pytest.raises(CompileError, match=r"^variant cu130: pkg-1.0-py3-none-any.whl holds no shared library"):
        check_wheel(wheel, "cuda", ("8.0",), "/nonexistent/cuobjdump", policy=policy, variant="cu130")
    check_wheel(wheel, "cpu", (), None, policy=policy, variant="cpu")  # a cpu wheel may be pure Python


@pytest.mark.parametrize("policy", ["exact", "at_least", "record"])
def test_a_gpu_wheel_whose_libraries_hold_only_host_code_fails_under_every_policy(tmp_path, policy):
    wheel = _wheel(tmp_path, {"pkg/libhost.so": b"\x7fELF host code only"})
    with pytest.raises(CompileError, match=r"(?s)variant rocm: .*no shared library embeds device code"):
        check_wheel(wheel, "hip", ("gfx942",), None, policy=policy, variant="rocm")
