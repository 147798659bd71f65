"""A CPython extension that links no libc still gets a manylinux tag.

An extension that calls only the Python C-API has no ``DT_NEEDED libc.so.6`` (it gets libc's symbols through
the interpreter): ``auditwheel show`` then "couldn't detect libc" and allows no policy, which left the cp310
cell of a matrix ``linux_x86_64`` (refused by PyPI). Kiln tells auditwheel the build host's libc.

Real parts: the cmatrix fixture's extension compiled here with gcc against this interpreter's headers, a wheel
written by Kiln's ``rewrite_wheel`` (the pep517 path the matrix cells take).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.tasks.project.config import load_config
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from kiln.tasks.wheel.manylinux import linux_platform, why_not_manylinux
from kiln.tasks.wheel.rewheel import rewrite_wheel
from tests.helpers.projects import copy_project

pytestmark = [pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc host")]
STAMP = WheelStamp.for_commit("c" * 40, 1764450423, {}, environ={})
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "projects" / "cmatrix"


def _needed(library: Path) -> list[str]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with library.open("rb") as handle:
        dynamic = ELFFile(handle).get_section_by_name(".dynamic")
        assert isinstance(dynamic, DynamicSection)
        return [tag.needed for tag in dynamic.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]


def test_an_extension_linking_no_libc_is_manylinux(tmp_path):
    extension = tmp_path / "_speedup.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f"-I{sysconfig.get_paths()['include']}", "-o", str(extension),
                    str(FIXTURE / "cmx" / "_speedup.c")], check=True, timeout=120, capture_output=True)
    assert not [n for n in _needed(extension) if n.startswith("libc.")], "the case this test is about"
    config = load_config(copy_project("cmatrix", tmp_path / "project"))
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    tag = f"{py}-{py}-{linux_platform()}"
    members = {"cmx/_speedup.so": extension.read_bytes(), "cmx/__init__.py": b"",
               "cmatrix-1.0.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: cmatrix\nVersion: 1.0.0\n",
               "cmatrix-1.0.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()}
    built = write_wheel(tmp_path / "built", f"cmatrix-1.0.0-{tag}.whl", sorted(members.items()), STAMP)
    wheel = rewrite_wheel(config, config.variants[0], "1.0.0.dev1+cpu", built, [], [], tmp_path / "out", STAMP)
    (wheel_tag,) = parse_wheel_filename(wheel.name)[3]
    assert wheel_tag.platform.startswith("manylinux_"), wheel.name
    assert why_not_manylinux(wheel, "cpu") == ""
