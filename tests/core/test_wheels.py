"""Reading wheels for the index: hash, size, METADATA sidecar, consistency with the filename."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.fsutil import sha256_bytes, sha256_file
from kiln.core.wheels import read_wheel
from tests.helpers.wheelkit import make_wheel


def test_read_wheel_hashes_file_and_extracts_metadata(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "Demo.Pkg", "1.0+cu130", requires_python=">=3.9")
    dist, metadata = read_wheel(path, upload_time=5)
    assert dist.filename == path.name and dist.project == "demo-pkg" and dist.version == "1.0+cu130"
    assert dist.sha256 == sha256_file(path) and dist.size == path.stat().st_size
    assert metadata.startswith(b"Metadata-Version: 2.1\nName: Demo.Pkg\n")
    assert dist.metadata_sha256 == sha256_bytes(metadata)
    assert dist.requires_python == ">=3.9" and dist.upload_time == 5


def test_wheel_whose_metadata_disagrees_with_its_filename_is_refused(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "demo", "1.0")
    renamed = path.with_name("demo-2.0-py3-none-any.whl")
    path.rename(renamed)
    with pytest.raises(InvalidInputError, match="METADATA says"):
        read_wheel(renamed)


def test_a_file_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidInputError, match="not a readable wheel"):
        read_wheel(path)


def test_a_wheel_without_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("demo/__init__.py", "")
    with pytest.raises(InvalidInputError, match="METADATA"):
        read_wheel(path)


def _zip(path: Path, members: dict[str, str]) -> bytes:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return path.read_bytes()


def test_import_names_come_from_the_wheel_not_the_distribution_name(tmp_path: Path) -> None:
    from kiln.core.wheels import import_names

    path = make_wheel(tmp_path, "tiny-kernels", "1.0", module="tinyk")
    assert import_names(path.name, path.read_bytes()) == ("tinyk",)


@pytest.mark.parametrize("members, expected", [
    ({"a-1.dist-info/top_level.txt": "pkg\nother\n", "pkg/__init__.py": "", "other.py": ""}, ("other", "pkg")),
    ({"kiln/runtime/__init__.py": "", "kiln/runtime/spec.py": ""}, ("kiln.runtime",)),  # a namespace portion
    ({"fast.cpython-311-x86_64-linux-gnu.so": "", "a-1.data/scripts/x": ""}, ("fast",)),
    ({"a-1.dist-info/METADATA": ""}, ()),
])
def test_import_names_read_top_level_or_record(tmp_path: Path, members: dict[str, str], expected: tuple) -> None:
    from kiln.core.wheels import import_names

    assert import_names("a-1-py3-none-any.whl", _zip(tmp_path / "a.whl", members)) == expected
