"""aarch64 wheels cross-built on this x86_64 builder (kiln.tasks.build.cross): a plain C extension compiled by
Debian's aarch64-linux-gnu-gcc, tagged manylinux for aarch64 by auditwheel's analysis, and picked by
``kiln which --platform manylinux_2_28_aarch64`` from an index that holds both CPUs' wheels."""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import zipfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.core.errors import EXIT_OK, CompileError, IntegrityError
from kiln.flows.cli import main
from kiln.tasks.build import cross
from kiln.tasks.project.config import Variant
from tests.helpers.wheelkit import make_wheel

FIXTURE = Path(__file__).parents[1] / "fixtures" / "projects" / "crossdot"
AARCH64 = cross.target("aarch64")
needs_cross_gcc = pytest.mark.skipif(cross.compiler(AARCH64) is None,
                                     reason="no aarch64-linux-gnu-gcc: install Debian's gcc-aarch64-linux-gnu")


@pytest.mark.parametrize(("platforms", "named"), [
    (("arm64",), "'arm64' is not a platform Kiln builds for (one of x86_64, aarch64); did you mean 'aarch64'?"),
    ((), "platform is empty"),
    (("aarch64", "aarch64"), "duplicate platforms in ['aarch64', 'aarch64']"),
])
def test_a_bad_platform_list_is_refused_naming_the_value(platforms: tuple[str, ...], named: str) -> None:
    with pytest.raises(ValidationError, match="platform") as info:
        Variant(name="cpu", backend="cpu", platform=platforms)
    assert named in str(info.value)


def test_a_variant_is_built_for_the_builders_own_cpu_unless_it_asks() -> None:
    assert Variant(name="cpu", backend="cpu").platform == ("x86_64",)
    assert Variant(name="cpu", backend="cpu", platform=("x86_64", "aarch64")).platform == ("x86_64", "aarch64")


def test_the_target_sysconfig_names_the_cross_toolchain_and_the_aarch64_extension_suffix() -> None:
    data = cross.sysconfig_data(AARCH64)
    assert str(data["CC"]).startswith("aarch64-linux-gnu-gcc")
    assert str(data["LDSHARED"]).startswith("aarch64-linux-gnu-gcc")
    assert str(data["EXT_SUFFIX"]).endswith("-aarch64-linux-gnu.so")
    assert data["Py_ENABLE_SHARED"] == 0 and data["LDFLAGS"] == ""


def test_a_header_package_whose_bytes_differ_from_its_pin_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="refusing it"):
        cross.target_pyconfig(AARCH64, "3.11", tmp_path, fetch=lambda url: b"!<arch>\nforged")  # a forged download
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def aarch64_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """crossdot's wheel, cross-built for aarch64 and tagged manylinux."""
    if cross.compiler(AARCH64) is None:
        pytest.skip("no aarch64-linux-gnu-gcc: install Debian's gcc-aarch64-linux-gnu")
    root = tmp_path_factory.mktemp("cross")
    project = Path(shutil.copytree(FIXTURE, root / "crossdot"))
    try:
        cross.staged_include(AARCH64, cross.default_cache_dir())
    except urllib.error.URLError as exc:
        pytest.skip(f"the pinned aarch64 CPython headers could not be downloaded (no network?): {exc}")
    built = cross.cross_build(project, root / "linux", AARCH64, cross.default_cache_dir(), timeout_s=300)
    assert built.name == "crossdot-0.1.0-cp311-cp311-linux_aarch64.whl"
    return cross.manylinux_tagged(built, root / "wheels", AARCH64, target_glibc="2_28")


@needs_cross_gcc
def test_a_c_extension_is_cross_built_into_an_aarch64_manylinux_wheel(aarch64_wheel: Path) -> None:
    assert aarch64_wheel.name == "crossdot-0.1.0-cp311-cp311-manylinux_2_28_aarch64.whl"
    with zipfile.ZipFile(aarch64_wheel) as archive:
        names = archive.namelist()
        library = archive.read("crossdot/_fast.cpython-311-aarch64-linux-gnu.so")
        wheel_file = archive.read("crossdot-0.1.0.dist-info/WHEEL").decode()
    assert "crossdot/__init__.py" in names
    assert library[:4] == b"\x7fELF" and int.from_bytes(library[18:20], "little") == 183  # EM_AARCH64
    assert "Tag: cp311-cp311-manylinux_2_28_aarch64" in wheel_file
    shown = subprocess.run([shutil.which("auditwheel") or "auditwheel", "show", str(aarch64_wheel)],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "manylinux_2_17_aarch64" in " ".join(shown.split())  # what its binaries allow; 2_28 is the target


@needs_cross_gcc
def test_a_target_older_than_the_binaries_allow_is_refused_naming_it(aarch64_wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(CompileError, match="manylinux_2_17_aarch64"):
        cross.manylinux_tagged(aarch64_wheel, tmp_path, AARCH64, target_glibc="2_5")


@needs_cross_gcc
def test_kiln_which_picks_the_aarch64_wheel_for_an_aarch64_platform(aarch64_wheel: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy2(aarch64_wheel, wheels / aarch64_wheel.name)
    make_wheel(wheels, "crossdot", "0.1.0", tag="cp311-cp311-manylinux_2_17_x86_64", requires_python=">=3.8",
               requires=["kiln-runtime==0.1.0"])
    make_wheel(wheels, "kiln-runtime", "0.1.0")
    assert main(["index", str(wheels), "--out", str(tmp_path / "index")]) == EXIT_OK
    url = (tmp_path / "index").as_uri() + "/"
    for platform, picked in (("manylinux_2_28_aarch64", aarch64_wheel.name),
                             ("manylinux_2_28_x86_64", "crossdot-0.1.0-cp311-cp311-manylinux_2_17_x86_64.whl")):
        capsys.readouterr()
        status = main(["which", url, "--project", "crossdot", "--python", "3.11", "--platform", platform,
                       "--torch", "none", "--cuda", "none", "--rocm", "none", "--arch", "none"])
        out = capsys.readouterr()
        assert status == EXIT_OK, out
        assert out.out.splitlines()[0].startswith(f"kiln which: {picked} fits Python 3.11"), out.out
