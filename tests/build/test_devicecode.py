"""The device-code check reads a wheel's shared libraries bounded (issue 33 item 3): each is inflated
streaming to a file, never past its limit, whatever the zip header says; the wheel and member are named."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError, MemberTooLargeError
from kiln.tasks.wheel.devicecode import wheel_contents
from tests.helpers.wheelkit import claim_member_size

MIB = 1 << 20
_BUNDLE = b"__CLANG_OFFLOAD_BUNDLE__"


def _library(target: str, padding_mib: int) -> bytes:
    ident = f"hipv4-amdgcn-amd-amdhsa--{target}".encode()
    bundle = _BUNDLE + struct.pack("<Q", 1) + struct.pack("<QQQ", 0, 0, len(ident)) + ident
    return b"\x7fELF host code" + bundle + b"\0" * (padding_mib * MIB)


def _wheel(tmp_path: Path, library: bytes) -> Path:
    path = tmp_path / "ember-1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("ember/__init__.py", "")
        archive.writestr("ember/_C.so", library)
    return path


def test_a_library_within_the_limit_is_checked_from_its_streamed_copy(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, _library("gfx942", padding_mib=3))
    found = wheel_contents(wheel, None, limit=4 * MIB)
    assert {name: sorted(c.gfx) for name, c in found.items()} == {"ember/_C.so": ["gfx942"]}


def test_a_library_whose_header_states_more_than_the_limit_is_refused_unread(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, _library("gfx942", padding_mib=8))
    with pytest.raises(MemberTooLargeError) as refused:
        wheel_contents(wheel, None, limit=4 * MIB)
    assert wheel.name in str(refused.value) and "ember/_C.so" in str(refused.value)
    assert "not read" in str(refused.value)


def test_a_header_that_lies_small_does_not_inflate_past_it(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, _library("gfx942", padding_mib=8))
    claim_member_size(wheel, "ember/_C.so", 1000)
    with pytest.raises((MemberTooLargeError, InvalidInputError)) as refused:
        wheel_contents(wheel, None, limit=4 * MIB)
    assert wheel.name in str(refused.value) and "ember/_C.so" in str(refused.value)
