"""Native wheels get the manylinux tag auditwheel's analysis of their binaries allows (issue 45, part 4).

Real parts: shared libraries compiled here with gcc (one linking only glibc, one linking a library named like
torch's, one linking a library no policy allows), a cubin compiled by nvcc, wheels written by Kiln's own writers
(``build_wheel``, ``rewrite_wheel``) and checked with the ``auditwheel show`` command line.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.tasks.build.cache import BuildCache
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel, write_wheel
from kiln.tasks.wheel.manylinux import (
    EXCLUDES,
    linux_platform,
    most_compatible,
    platform_verdict,
    wheel_file_tagged,
    why_not_manylinux,
)
from kiln.tasks.wheel.rewheel import rewrite_wheel
from kiln.tasks.wheel.variants import write_variant_wheels
from tests.helpers.projects import copy_project

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
STAMP = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0"}, environ={})
_SOURCE = '#include <string.h>\nint kiln_op(char *d, const char *s, unsigned long n) { memcpy(d, s, n); return 0; }\n'


def _gcc(out: Path, source: str, *link: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src), f"-L{out.parent}", *link],
                   check=True, timeout=120, capture_output=True)
    return out


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``plain``: glibc only; ``torch``: links libtorch_cpu.so and libcudart.so.13 (stand-ins named as torch's
    and CUDA's, not in the wheel); ``foreign``: links libfoo.so, which no policy allows."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    root = tmp_path_factory.mktemp("libs")
    for name in ("libtorch_cpu.so", "libcudart.so.13", "libfoo.so"):
        _gcc(root / name, f"int {name.split('.')[0]}_sym(void) {{ return 1; }}\n", f"-Wl,-soname,{name}")
    uses = "int libtorch_cpu_sym(void); int libcudart_sym(void); int libfoo_sym(void);\n"
    return {"plain": _gcc(root / "libplain.so", _SOURCE),
            "torch": _gcc(root / "libext.so", _SOURCE + uses + "int f(void) { return libtorch_cpu_sym()"
                          " + libcudart_sym(); }\n", "-l:libtorch_cpu.so", "-l:libcudart.so.13"),
            "foreign": _gcc(root / "libforeign.so", _SOURCE + uses + "int f(void) { return libfoo_sym(); }\n",
                            "-lfoo")}


def _tiny(tmp_path: Path) -> KilnConfig:
    return load_config(copy_project("tiny", tmp_path))


def _kiln_wheel(tmp_path: Path, library: Path, out: str = "wheels", cache: BuildCache | None = None) -> Path:
    config = _tiny(tmp_path / out)
    return build_wheel(config, "0.1.0.dev20261129+cu130", [WheelInput(library, f"cuda/{library.name}")], [],
                       tmp_path / out, variant=config.variant("cu130"), stamp=STAMP, cache=cache)


def _show(wheel: Path) -> dict[str, object]:
    """``auditwheel show --json``: the command line, not Kiln's reading of the library."""
    done = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)], check=True,
                          timeout=300, capture_output=True, text=True)
    report: dict[str, object] = json.loads(done.stdout)
    return report


def _platform(wheel: Path) -> str:
    (tag,) = parse_wheel_filename(wheel.name)[3]
    return tag.platform


def _wheel_tags(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
        text = archive.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]


@needs_gcc
def test_a_library_linking_only_glibc_gets_the_manylinux_tag_auditwheel_show_confirms(tmp_path, libs):
    wheel = _kiln_wheel(tmp_path, libs["plain"])
    tag = _platform(wheel)
    assert tag.startswith("manylinux_2_") and _wheel_tags(wheel) == [f"py3-none-{tag}"]
    report = _show(wheel)
    assert report["overall_tag"] == tag and report["external_libs"] == {}
    assert why_not_manylinux(wheel, "cuda") == ""


@needs_gcc
def test_torch_and_cuda_libraries_are_excluded_never_grafted(tmp_path, libs):
    wheel = _kiln_wheel(tmp_path, libs["torch"])
    tag = _platform(wheel)
    assert tag.startswith("manylinux_2_")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if any(fnmatch(n.rsplit("/", 1)[-1], p) for p in EXCLUDES["cuda"])]
    assert not [n for n in names if ".libs/" in n]  # auditwheel repair's graft directory
    # auditwheel show, which excludes nothing, agrees on the symbols and names only torch's and CUDA's libraries
    report = _show(wheel)
    assert report["sym_tag"] == tag
    assert sorted(report["external_libs"]) == ["libcudart.so.13", "libtorch_cpu.so"]  # type: ignore[arg-type]


@needs_gcc
def test_a_library_no_policy_allows_keeps_linux_and_the_summary_says_why(tmp_path, libs):
    cache = BuildCache(tmp_path / "cache")
    wheel = _kiln_wheel(tmp_path, libs["foreign"], cache=cache)
    assert _platform(wheel) == linux_platform()
    why = why_not_manylinux(wheel, "cuda", cache)
    assert "links libfoo.so" in why and "never grafts" in why
    assert "libfoo.so" in _show(wheel)["external_libs"]  # type: ignore[operator]


@needs_gcc
def test_the_tag_is_the_same_in_any_directory_and_with_a_warm_cache(tmp_path, libs):
    cache = BuildCache(tmp_path / "cache")
    first = _kiln_wheel(tmp_path, libs["torch"], "one", cache=cache)
    moved = tmp_path / "elsewhere" / "deeper" / "libext.so"
    moved.parent.mkdir(parents=True)
    shutil.copy2(libs["torch"], moved)
    second = _kiln_wheel(tmp_path, moved, "a-much-longer-directory-name")
    warm = _kiln_wheel(tmp_path, libs["torch"], "three", cache=cache)
    assert first.name == second.name == warm.name and _platform(first).startswith("manylinux_2_")
    assert first.read_bytes() == second.read_bytes() == warm.read_bytes()
    assert len(list((tmp_path / "cache" / "entries" / "manylinux").glob("*.json"))) == 1  # one analysis kept


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_wheel_of_device_code_only_gets_the_most_compatible_policy(tmp_path):
    source = tmp_path / "k.cu"
    source.write_text("extern \"C\" __global__ void k(float *x) { x[0] = 1.0f; }\n")
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_80", "-o", str(cubin), str(source)], check=True, timeout=300,
                   capture_output=True)
    wheel = _kiln_wheel(tmp_path, cubin)
    assert _platform(wheel) == most_compatible() == "manylinux_2_5_x86_64"
    verdict = platform_verdict([("k.cubin", cubin.read_bytes())], "cuda")
    assert verdict.manylinux and "device code only" in verdict.reason


@needs_gcc
def test_the_variant_wheel_keeps_the_platform_tag_of_its_local_wheel(tmp_path, libs):
    """PEP 825: the variant wheel is the same contents under the public version, its label after the (manylinux)
    platform tag, in its name and its WHEEL file alike."""
    config = _tiny(tmp_path / "config")
    wheel = _kiln_wheel(tmp_path, libs["plain"])
    (variant_wheel,) = write_variant_wheels(config, config.variant("cu130"), wheel, tmp_path / "variant-wheels", STAMP)
    tag = _platform(wheel)
    assert variant_wheel.name == f"tiny_kernels-0.1.0.dev20261129-py3-none-{tag}-cu130.whl"
    assert _wheel_tags(variant_wheel) == _wheel_tags(wheel) == [f"py3-none-{tag}"]


@needs_gcc
def test_a_backend_built_extension_is_retagged_in_its_name_and_wheel_file(tmp_path, libs):
    """ember as its backend writes it (cp311-cp311-linux_x86_64): the rewritten wheel is manylinux, in its
    name and in every Tag line of its WHEEL file, the backend's other lines kept."""
    config = load_config(copy_project("ember", tmp_path))
    plat = linux_platform()
    members = {"ember/_C.so": libs["torch"].read_bytes(), "ember/__init__.py": b"",
               "ember_ops-0.2.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ember-ops\nVersion: 0.2.0\n",
               "ember_ops-0.2.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: setuptools (80.9.0)\n"
                                                  f"Root-Is-Purelib: false\nTag: cp311-cp311-{plat}\n\n".encode()}
    built = write_wheel(tmp_path / "built", f"ember_ops-0.2.0-cp311-cp311-{plat}.whl", sorted(members.items()),
                        STAMP)
    wheel = rewrite_wheel(config, config.variant("cu130"), "0.2.0.dev1+cu130", built, [], [], tmp_path / "out", STAMP)
    tag = _platform(wheel)
    assert tag.startswith("manylinux_2_") and wheel.name == f"ember_ops-0.2.0.dev1+cu130-cp311-cp311-{tag}.whl"
    assert _wheel_tags(wheel) == [f"cp311-cp311-{tag}"]
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read("ember_ops-0.2.0.dev1+cu130.dist-info/WHEEL").decode()
    assert text.startswith("Wheel-Version: 1.0\nGenerator: setuptools (80.9.0)\nRoot-Is-Purelib: false\n")
    assert _show(wheel)["sym_tag"] == tag


@pytest.mark.parametrize(("wheel_file", "expected"), [
    ("Wheel-Version: 1.0\nTag: cp311-cp311-{plat}\n", "Wheel-Version: 1.0\nTag: cp311-cp311-NEW\n"),
    ("Tag: py3-none-{plat}\r\nTag: py2-none-{plat}\r\n", "Tag: py3-none-NEW\r\nTag: py2-none-NEW\r\n"),
    ("Tag: py3-none-manylinux_2_17_x86_64\n", "Tag: py3-none-manylinux_2_17_x86_64\n"),
    ("Generator: x-{plat}\n", "Generator: x-{plat}\n"),
])
def test_only_tag_lines_on_the_plain_linux_platform_are_moved(wheel_file, expected):
    plat = linux_platform()
    moved = wheel_file_tagged(wheel_file.format(plat=plat).encode(), "cp311-cp311-NEW")
    assert moved == expected.format(plat=plat).encode()


def test_a_wheel_without_host_binaries_is_not_analysed():
    verdict = platform_verdict([("pkg/__init__.py", b"x = 1\n"), ("pkg/data.bin", b"\x00")], "cpu")
    assert verdict.platform == linux_platform() and "no ELF binary" in verdict.reason


def _elf(machine: int, elfclass: int = 2, order: int = 1) -> bytes:
    fmt = "<H" if order == 1 else ">H"
    return b"\x7fELF" + bytes([elfclass, order, 1]) + b"\0" * 11 + b"\x02\x00" + struct.pack(fmt, machine) + b"\0" * 44


@pytest.mark.parametrize("data", [
    _elf(62), _elf(190), _elf(224), _elf(0x7777), _elf(62, elfclass=1), _elf(62, order=2), _elf(62, elfclass=3),
    _elf(62, order=0), _elf(62)[:52], _elf(62, elfclass=1)[:51], _elf(62)[:5], b"\x7fELF", b"not an ELF file",
    Path(sys.executable).resolve().read_bytes()[:4096],
])
def test_the_elf_machine_read_from_the_header_is_what_pyelftools_reads(data):
    from io import BytesIO

    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    from kiln.tasks.wheel.manylinux import _machine

    try:
        expected = str(ELFFile(BytesIO(data)).header["e_machine"]) if data[:4] == b"\x7fELF" else None
    except ELFError:
        expected = None
    assert _machine(data) == expected
