"""A declared manylinux target (kiln.toml ``[build] manylinux = "2_28"``): the wheel is tagged for it, or its
unit fails naming the symbols whose versions are newer than the target's policy allows.

Real parts: shared libraries compiled here with gcc against this machine's glibc (Debian 12: 2.36), so one
calling ``dlopen`` needs ``GLIBC_2.34`` (libdl moved into libc in 2.34); wheels written by Kiln's own writers
(``build_wheel``, ``rewrite_wheel``: what the build stage calls), checked with the ``auditwheel show`` command.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.core.errors import AbiAuditError, ConfigError
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel, write_wheel
from kiln.tasks.wheel.manylinux import linux_platform
from kiln.tasks.wheel.rewheel import rewrite_wheel
from tests.helpers.projects import copy_project

pytestmark = [pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
              pytest.mark.skipif(platform.machine() != "x86_64", reason="the tags asserted are x86_64's")]
STAMP = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0"}, environ={})
_DLOPEN = "#include <dlfcn.h>\nvoid *kiln_open(const char *p) { return dlopen(p, RTLD_NOW); }\n"
_MEMCPY = '#include <string.h>\nint kiln_op(char *d, const char *s, unsigned long n) { memcpy(d, s, n); return 0; }\n'


def _glibc() -> tuple[int, int]:
    major, minor = platform.libc_ver()[1].split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``dlopen``: needs GLIBC_2.34 on a glibc >= 2.34 host; ``memcpy``: needs GLIBC_2.14 at most."""
    if _glibc() < (2, 34):
        pytest.skip("the host's glibc is older than 2.34: dlopen is not versioned GLIBC_2.34 here")
    root = tmp_path_factory.mktemp("libs")
    out = {}
    for name, source in (("dlopen", _DLOPEN), ("memcpy", _MEMCPY)):
        (root / f"{name}.c").write_text(source)
        out[name] = root / f"lib{name}.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out[name]), str(root / f"{name}.c")],
                       check=True, timeout=120, capture_output=True)
    return out


def _tiny(tmp_path: Path, target: str | None) -> KilnConfig:
    toml = copy_project("tiny", tmp_path)
    if target is not None:
        toml.write_text(toml.read_text().replace("[build]\n", f'[build]\nmanylinux = "{target}"\n', 1))
    return load_config(toml)


def _kiln_wheel(tmp_path: Path, library: Path, target: str | None) -> Path:
    config = _tiny(tmp_path / "project", target)
    return build_wheel(config, "0.1.0.dev20261129+cu130", [WheelInput(library, f"cuda/{library.name}")], [],
                       tmp_path / "wheels", variant=config.variant("cu130"), stamp=STAMP)


def _platform(wheel: Path) -> str:
    (tag,) = parse_wheel_filename(wheel.name)[3]
    return tag.platform


def _show(wheel: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)], check=True,
                          timeout=300, capture_output=True, text=True)
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_a_wheel_needing_glibc_2_34_is_refused_for_2_28_naming_the_symbol(tmp_path, libs):
    with pytest.raises(AbiAuditError) as caught:
        _kiln_wheel(tmp_path, libs["dlopen"], "2_28")
    message = str(caught.value)
    assert "manylinux target 2_28" in message and "manylinux_2_28_x86_64" in message
    assert "tinyk/_aot/cuda/libdlopen.so: dlopen@GLIBC_2.34" in message
    assert "__cxa_finalize" not in message  # GLIBC_2.2.5 meets the target: only what pushes it newer is named
    assert not list((tmp_path / "wheels").glob("*.whl"))  # refused before it is written


def test_the_same_wheel_meets_2_34_and_is_tagged_for_it(tmp_path, libs):
    wheel = _kiln_wheel(tmp_path, libs["dlopen"], "2_34")
    assert _platform(wheel) == "manylinux_2_34_x86_64"
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read("tiny_kernels-0.1.0.dev20261129+cu130.dist-info/WHEEL").decode()
    assert "Tag: py3-none-manylinux_2_34_x86_64\n" in text
    assert _show(wheel)["sym_tag"] == "manylinux_2_34_x86_64"  # auditwheel itself: 2_34 is what it needs


def test_a_wheel_older_than_the_target_is_tagged_for_the_target(tmp_path, libs):
    """The tag says what the team promised: an older policy meets the target, so the wheel says the target."""
    untargeted = _kiln_wheel(tmp_path / "plain", libs["memcpy"], None)
    targeted = _kiln_wheel(tmp_path / "targeted", libs["memcpy"], "2_28")
    assert _platform(untargeted) != "manylinux_2_28_x86_64"
    assert _platform(targeted) == "manylinux_2_28_x86_64"


def test_a_backend_built_wheel_is_refused_too(tmp_path, libs):
    """The pep517 path (the backend's own wheel, rewritten by Kiln) meets the same check."""
    toml = copy_project("ember", tmp_path / "project")
    toml.write_text(toml.read_text().replace("[build]\n", '[build]\nmanylinux = "2_28"\n', 1))
    config = load_config(toml)
    assert config.build.manylinux == "2_28"
    plat = linux_platform()
    members = {"ember/_C.so": libs["dlopen"].read_bytes(), "ember/__init__.py": b"",
               "ember_ops-0.2.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ember-ops\nVersion: 0.2.0\n",
               "ember_ops-0.2.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                                  f"Tag: cp311-cp311-{plat}\n".encode()}
    built = write_wheel(tmp_path / "built", f"ember_ops-0.2.0-cp311-cp311-{plat}.whl", sorted(members.items()),
                        STAMP)
    with pytest.raises(AbiAuditError, match=r"ember/_C.so: dlopen@GLIBC_2.34"):
        rewrite_wheel(config, config.variant("cu130"), "0.2.0.dev1+cu130", built, [], [], tmp_path / "out", STAMP)


def test_a_tag_the_backend_chose_is_checked_against_the_target_too(tmp_path, libs):
    """A backend that tags its own wheel (say manylinux_2_34, after its own auditwheel run) keeps that tag, but
    a target it does not meet still fails the unit, naming the symbols."""
    toml = copy_project("ember", tmp_path / "project")
    toml.write_text(toml.read_text().replace("[build]\n", '[build]\nmanylinux = "2_28"\n', 1))
    config = load_config(toml)
    tag = "cp311-cp311-manylinux_2_34_x86_64"
    members = {"ember/_C.so": libs["dlopen"].read_bytes(), "ember/__init__.py": b"",
               "ember_ops-0.2.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ember-ops\nVersion: 0.2.0\n",
               "ember_ops-0.2.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()}
    built = write_wheel(tmp_path / "built", f"ember_ops-0.2.0-{tag}.whl", sorted(members.items()), STAMP)
    with pytest.raises(AbiAuditError, match=r"ember/_C.so: dlopen@GLIBC_2.34"):
        rewrite_wheel(config, config.variant("cu130"), "0.2.0.dev1+cu130", built, [], [], tmp_path / "out", STAMP)


@pytest.mark.parametrize(("value", "says"), [
    ("2.28", "'2_NN' form"), ("manylinux_2_28", "'2_NN' form"), ("2_028", "'2_NN' form"), ("3_1", "'2_NN' form"),
    ("2_29", "no manylinux_2_29 policy"),
])
def test_a_malformed_or_unknown_target_is_a_clear_config_error(tmp_path, value, says):
    with pytest.raises(ConfigError, match=rf"manylinux.*{value}.*{says}"):
        _tiny(tmp_path, value)


def test_no_target_is_the_default(tmp_path):
    assert _tiny(tmp_path, None).build.manylinux is None
