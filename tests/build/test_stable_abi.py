"""The stable-ABI mode's pure parts: the target torch's define, the build's variables, the wheel's torch line,
its tag, and kiln.toml's torch_target (issue 45, part 2)."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConfigError
from kiln.tasks.project.config import Variant
from kiln.tasks.wheel.stable_abi import (
    build_target,
    series,
    stable_environ,
    target_hex,
    torch_specifier,
    untied_tag,
    wheel_file_retagged,
)


@pytest.mark.parametrize(("version", "value"), [("2.13", "0x020d000000000000"), ("2.14.1+cu130", "0x020e000000000000"),
                                                ("2.9.0", "0x0209000000000000"), ("3.0", "0x0300000000000000")])
def test_target_hex_packs_major_and_minor_as_torch_headers_do(version: str, value: str) -> None:
    assert target_hex(version) == value


def test_series_is_major_minor_and_a_bad_version_is_named() -> None:
    assert series("2.14.1+cu130") == "2.14"
    with pytest.raises(ConfigError, match="'two' is not a torch version"):
        series("two")


@pytest.mark.parametrize(("declared", "built", "target"), [(None, "2.14.1+cu130", "2.14"), ("2.13", "2.14.1", "2.13"),
                                                           ("2.14", "2.14.1", "2.14")])
def test_build_target_is_the_declared_one_else_the_build_torch(declared: str | None, built: str, target: str) -> None:
    assert build_target(declared, built) == target


def test_a_target_newer_than_the_build_torch_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"torch_target = '2.15' is newer than the torch .* \(2.14.1\)"):
        build_target("2.15", "2.14.1")


def test_stable_environ_appends_the_define_to_each_compiler_and_keeps_their_flags() -> None:
    env = stable_environ({"CPPFLAGS": "-DOWN=1", "NVCC_APPEND_FLAGS": "-I/x", "PATH": "/bin"}, "2.13")
    define = "-DTORCH_TARGET_VERSION=0x020d000000000000"
    assert env["CPPFLAGS"] == f"-DOWN=1 {define}" and env["NVCC_APPEND_FLAGS"] == f"-I/x {define}"
    assert env["HIPCC_COMPILE_FLAGS_APPEND"] == define and "CXXFLAGS" not in env  # CXXFLAGS would replace -O3
    assert env["TORCH_TARGET_VERSION"] == "0x020d000000000000" and env["PATH"] == "/bin"


@pytest.mark.parametrize(("stable", "built", "declared", "audited", "spec"), [
    (False, "2.14.1+cu130", None, None, "==2.14.*"),  # exact: the release series it was built against
    (False, "2.13.0", None, "2.10.0", "==2.13.*"),  # the audit does not loosen an exact variant
    (True, "2.14.1", "2.13", "2.10.0", ">=2.13"),  # the declared target is above the audit's floor
    (True, "2.14.1", "2.10", "2.13.0", ">=2.13.0"),  # the audit's floor is above the target
    (True, "2.14.1", None, None, ">=2.14"),  # no target: the torch it built against
])
def test_torch_specifier(stable: bool, built: str, declared: str | None, audited: str | None, spec: str) -> None:
    assert torch_specifier(stable, built, declared, audited) == spec


@pytest.mark.parametrize(("tag", "python_api", "expected"), [
    ("cp311-cp311-manylinux_2_28_x86_64", [False], "py3-none-manylinux_2_28_x86_64"),
    ("cp311-cp311-manylinux_2_28_x86_64", [False, True], "cp311-cp311-manylinux_2_28_x86_64"),
    ("cp310-abi3-manylinux_2_28_x86_64", [False], "py3-none-manylinux_2_28_x86_64"),  # abi3 would refuse 3.9
    ("cp310-abi3-manylinux_2_28_x86_64", [True], "cp310-abi3-manylinux_2_28_x86_64"),  # a Python extension
    ("py3-none-linux_x86_64", [False], "py3-none-linux_x86_64"),
    ("cp311-cp311-linux_x86_64", [], "cp311-cp311-linux_x86_64"),  # no library: nothing to judge
])
def test_a_wheel_with_no_python_c_api_fits_every_python(tag: str, python_api: list[bool], expected: str) -> None:
    assert untied_tag(tag, python_api) == expected


def test_wheel_file_retagged_keeps_every_other_line() -> None:
    before = b"Wheel-Version: 1.0\nGenerator: setuptools\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n"
    after = wheel_file_retagged(before, "py3-none-manylinux_2_28_x86_64")
    assert after == before.replace(b"cp311-cp311-linux_x86_64", b"py3-none-manylinux_2_28_x86_64")


def test_torch_target_needs_the_stable_abi_and_a_major_minor() -> None:
    assert Variant(name="cpu", backend="cpu", abi="stable", torch_target="2.13").torch_target == "2.13"
    with pytest.raises(ValueError, match='torch_target = .2.13. needs abi = "stable"'):
        Variant(name="cpu", backend="cpu", torch_target="2.13")
    with pytest.raises(ValueError, match="torch_target"):
        Variant(name="cpu", backend="cpu", abi="stable", torch_target="2.13.0")


def test_a_stable_variant_builds_once_per_python_against_its_newest_torch_targeting_its_oldest() -> None:
    from kiln.tasks.project.config_matrix import expand

    stable = Variant(name="cpu", backend="cpu", abi="stable", python=("3.11", "3.12"), torch=("2.14.1", "2.13.0"))
    cells = expand(stable)
    assert [(c.name, c.label, c.build_requires, c.torch_target) for c in cells] == [
        ("cpupy311", "cpu", ("torch==2.14.1",), "2.13"), ("cpupy312", "cpu", ("torch==2.14.1",), "2.13")]
    exact = expand(stable.model_copy(update={"abi": "exact"}))  # one cell per torch, as before
    assert len(exact) == 4 and {c.label for c in exact} == {"cputorch2.13", "cputorch2.14"}
    declared = expand(stable.model_copy(update={"torch_target": "2.14"}))
    assert {c.torch_target for c in declared} == {"2.14"}
