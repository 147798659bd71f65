"""kiln which through the command line, on an index `kiln index` made of real wheels; pip installs what it prints."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import pytest

from kiln.core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from kiln.flows.cli import main
from tests.helpers.staticserver import static_server
from tests.helpers.wheelkit import make_wheel

CPU_WHEEL = "kiln_kernels-0.1.0+cpu-cp311-cp311-linux_x86_64.whl"
CU130_WHEEL = "kiln_kernels-0.1.0+cu130-cp312-cp312-linux_x86_64.whl"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A Kiln index (a +cpu cp311 wheel pinning torch 2.13.0, a +cu130 cp312 one pinning torch 2.14.1, and
    kiln-runtime), and a stand-in for PyPI holding the torch they pin."""
    root = tmp_path_factory.mktemp("which")
    runtime = "kiln-runtime==0.1.0"
    make_wheel(root / "wheels", "kiln-kernels", "0.1.0+cpu", tag="cp311-cp311-linux_x86_64",
               requires_python=">=3.10", requires=["torch==2.13.0", runtime])
    make_wheel(root / "wheels", "kiln-kernels", "0.1.0+cu130", tag="cp312-cp312-linux_x86_64",
               requires_python=">=3.10", requires=["torch==2.14.1", runtime])
    make_wheel(root / "wheels", "kiln-runtime", "0.1.0")
    make_wheel(root / "deps", "torch", "2.14.1")
    assert main(["index", str(root / "wheels"), "--out", str(root / "index")]) == EXIT_OK
    assert main(["index", str(root / "deps"), "--out", str(root / "pypi")]) == EXIT_OK
    return (root / "index").as_uri() + "/", (root / "pypi").as_uri() + "/"


def _which(capsys: pytest.CaptureFixture[str], url: str, *axes: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = main(["which", url, "--platform", "linux_x86_64", "--arch", "none", *axes])
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).splitlines()


def _dry_run(step: str, python: str, report: Path) -> list[str]:
    """Run one printed ``pip install …`` step as a dry run for ``python``'s platform; the files pip would install."""
    argv = shlex.split(step)
    assert argv[:5] == ["env", "PIP_CONFIG_FILE=/dev/null", "pip", "install", "--isolated"], step
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
               "--dry-run", "--ignore-installed", "--report", str(report), "--python-version", python,
               "--platform", "linux_x86_64", "--only-binary=:all:", *argv[4:]]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    return sorted(item["download_info"]["url"].rsplit("/", 1)[-1].replace("%2B", "+")
                  for item in json.loads(report.read_text())["install"])


def test_which_prints_the_command_that_installs_the_cpu_wheel(indexes: tuple[str, str], capsys, tmp_path) -> None:
    url, _ = indexes
    status, lines = _which(capsys, url, "--python", "3.11", "--torch", "2.13.0", "--cuda", "none")
    assert status == EXIT_OK, lines
    assert lines[0] == (f"kiln which: {CPU_WHEEL} fits Python 3.11, cp311-cp311-linux_x86_64, torch 2.13.0, "
                        "no GPU backend (cpu)")
    assert lines[-1] == f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} kiln-kernels==0.1.0+cpu"
    # its dependencies are not all on this index: the install itself, without them
    assert _dry_run(lines[-1] + " --no-deps", "3.11", tmp_path / "report.json") == [CPU_WHEEL]


def test_which_with_an_extra_index_prints_two_steps_that_install(indexes: tuple[str, str], capsys, tmp_path) -> None:
    url, pypi = indexes
    status, lines = _which(capsys, url, "--python", "3.12", "--torch", "2.14.1", "--cuda", "13.0",
                           "--extra-index-url", pypi)
    assert status == EXIT_OK, lines
    first, second = lines[-1].split(" && ")
    assert first == f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} --no-deps kiln-kernels==0.1.0+cu130 kiln-runtime==0.1.0"
    assert _dry_run(first, "3.12", tmp_path / "first.json") == [CU130_WHEEL, "kiln_runtime-0.1.0-py3-none-any.whl"]
    assert _dry_run(second, "3.12", tmp_path / "second.json") == [
        CU130_WHEEL, "kiln_runtime-0.1.0-py3-none-any.whl", "torch-2.14.1-py3-none-any.whl"]


@pytest.mark.parametrize(("axes", "reason"), [
    (("--python", "3.12", "--torch", "2.12", "--cuda", "13.0"),
     "no wheel for torch 2.12: kiln-kernels 0.1.0+cu130 requires torch==2.14.1"),
    (("--python", "3.13", "--torch", "2.14.1", "--cuda", "13.0"), "no cp313 wheel: the index has cp311, cp312 only"),
    (("--python", "3.12", "--torch", "2.14.1", "--cuda", "12.8"),
     "no wheel for CUDA 12.8: kiln-kernels 0.1.0 has +cpu (no GPU backend (cpu)), +cu130 (CUDA 13.0)"),
])
def test_which_says_why_no_wheel_fits(indexes: tuple[str, str], capsys, axes: tuple[str, ...], reason: str) -> None:
    status, lines = _which(capsys, indexes[0], *axes)
    assert status == EXIT_FAILED
    assert lines[0].startswith(f"kiln which: no wheel of kiln-kernels 0.1.0 on {indexes[0]} fits Python")
    assert lines[1:] == [f"  - {reason}"]


@pytest.mark.parametrize(("args", "named"), [
    (("--python", "three"), "--python 'three'"),
    (("--project", "nope", "--python", "3.11"), "holds no project 'nope'; it holds kiln-kernels, kiln-runtime"),
    (("--version", "0.2.0", "--python", "3.11"), "kiln-kernels has no version 0.2.0 on this index; it has 0.1.0"),
])
def test_which_refuses_bad_input_by_name(indexes: tuple[str, str], capsys, args: tuple[str, ...], named: str) -> None:
    status, lines = _which(capsys, indexes[0], "--torch", "none", "--cuda", "none", *args)
    assert status == EXIT_USAGE
    assert named in lines[-1]


def test_which_refuses_an_index_that_is_not_there(capsys, tmp_path: Path) -> None:
    status, lines = _which(capsys, (tmp_path / "absent").as_uri(), "--torch", "none", "--cuda", "none")
    assert status == EXIT_USAGE
    assert "is not a directory" in lines[-1]


def test_which_reads_an_index_behind_a_static_http_server(indexes: tuple[str, str], capsys) -> None:
    directory = Path(url2pathname(urlsplit(indexes[0]).path))
    with static_server(directory) as base:
        url = base.rstrip("/") + "/"
        status, lines = _which(capsys, url, "--python", "3.12", "--torch", "2.14.1", "--cuda", "13.0")
    assert status == EXIT_OK, lines
    assert lines[-1] == f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} kiln-kernels==0.1.0+cu130"


def test_a_plain_wheel_beside_labelled_ones_is_pinned_with_arbitrary_equality(tmp_path: Path, capsys) -> None:
    """``==0.1.0`` also matches ``0.1.0+cu130``, which pip ranks higher: the plain wheel needs ``===0.1.0``."""
    make_wheel(tmp_path / "wheels", "kiln-kernels", "0.1.0")
    make_wheel(tmp_path / "wheels", "kiln-kernels", "0.1.0+cu130", tag="py3-none-linux_x86_64")
    assert main(["index", str(tmp_path / "wheels"), "--out", str(tmp_path / "index")]) == EXIT_OK
    url = (tmp_path / "index").as_uri() + "/"
    status, lines = _which(capsys, url, "--python", "3.11", "--torch", "none", "--cuda", "none")
    assert status == EXIT_OK, lines
    assert lines[-1] == f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} kiln-kernels===0.1.0"
    assert _dry_run(lines[-1], "3.11", tmp_path / "report.json") == ["kiln_kernels-0.1.0-py3-none-any.whl"]
