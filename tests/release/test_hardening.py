"""Hostile input to ``kiln index`` and the local store (issue 33): zip bombs, lying RECORDs, links under
the output root, non-finite sizes and times. Real files and a real ``kiln index`` subprocess throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError, MemberTooLargeError, RecordMismatchError, UnsafePathError
from kiln.core.store import LocalStore
from kiln.core.wheels import check_record, read_wheel, record_problems
from kiln.release.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, index_command
from tests.helpers.wheelkit import claim_member_size, make_wheel, rewrite_members

MIB = 1 << 20
BOMB_MIB = 300
MAX_RSS_GROWTH_MB = 200
SUBPROCESS_TIMEOUT_S = 300


def _bomb(directory: Path, name: str = "bomb", inflated_mib: int = BOMB_MIB) -> Path:
    """A small wheel whose METADATA inflates to ``inflated_mib`` MiB (written streaming: the test stays small)."""
    info_dir = f"{name}-1.0.dist-info"
    path = directory / f"{name}-1.0-py3-none-any.whl"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{name}/__init__.py", "")
        info = zipfile.ZipInfo(f"{info_dir}/METADATA", (2020, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w") as member:
            member.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nSummary: ".encode())
            zeros = b"0" * MIB
            for _ in range(inflated_mib):
                member.write(zeros)
        archive.writestr(f"{info_dir}/RECORD", "")
    return path


def _deflated_bomb(directory: Path) -> Path:
    path = _bomb(directory)
    with zipfile.ZipFile(path) as archive:
        metadata = next(i for i in archive.infolist() if i.filename.endswith("METADATA"))
    assert metadata.compress_type == zipfile.ZIP_DEFLATED and metadata.file_size > BOMB_MIB * MIB
    return path


@pytest.mark.slow
def test_a_zip_bomb_metadata_is_refused_naming_the_wheel_and_member(tmp_path: Path) -> None:
    path = _deflated_bomb(tmp_path)
    assert path.stat().st_size < 2 * MIB  # the "300 KB wheel" of the issue
    with pytest.raises(MemberTooLargeError) as refused:
        read_wheel(path)
    assert path.name in str(refused.value) and "bomb-1.0.dist-info/METADATA" in str(refused.value)


_MEASURE = """
import resource, sys
from kiln.release.cli import index_command
import kiln.core.wheels, zipfile, email.parser
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
status = index_command(sys.argv[1], None, sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"STATUS {status} GROWTH_KB {after - before}")
"""


@pytest.mark.slow
def test_kiln_index_refuses_a_zip_bomb_with_bounded_memory_and_writes_nothing(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    path = _deflated_bomb(wheels)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(wheels), str(out)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path)
    status, growth_kb = done.stdout.split()[1], int(done.stdout.split()[3])
    assert int(status) == EXIT_USAGE, done.stdout + done.stderr
    assert path.name in done.stderr and "METADATA" in done.stderr and "Traceback" not in done.stderr
    assert growth_kb < MAX_RSS_GROWTH_MB * 1024, f"peak RSS grew by {growth_kb} KB"
    assert not out.exists()


@pytest.mark.slow
def test_a_zip_header_that_lies_small_does_not_inflate_past_it(tmp_path: Path) -> None:
    path = _bomb(tmp_path, inflated_mib=64)
    claim_member_size(path, "bomb-1.0.dist-info/METADATA", 1000)
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo("bomb-1.0.dist-info/METADATA").file_size == 1000
    with pytest.raises(InvalidInputError) as refused:
        read_wheel(path)
    assert path.name in str(refused.value) and "METADATA" in str(refused.value)


def test_a_true_record_has_no_problems(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "demo", "1.0")
    assert record_problems(path.name, path) == []


def test_a_lying_record_is_named_member_by_member(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "demo", "1.0")
    rewrite_members(path, {"demo/__init__.py": b"print('not what RECORD says')\n", "demo/extra.py": b""})
    problems = record_problems(path.name, path)
    assert any("RECORD says demo/__init__.py" in p for p in problems), problems
    assert any("demo/extra.py is not listed in RECORD" in p for p in problems), problems
    with pytest.raises(RecordMismatchError, match="demo/__init__.py"):
        check_record(path.name, path)


def test_kiln_index_refuses_a_wheel_whose_record_lies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_wheel(tmp_path / "wheels", "demo", "1.0")
    rewrite_members(path, {"demo/__init__.py": b"x = 1\n"})
    assert index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out")) == EXIT_FAILED
    assert "RECORD" in capsys.readouterr().err and not (tmp_path / "out").exists()


# --- no writes through links ------------------------------------------------------------------------


def _linked_out(tmp_path: Path) -> tuple[Path, Path]:
    """``out/demo -> ../outside``: an existing index whose project directory is a link out of it."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "index.html").write_text("old")
    os.symlink("../outside", out / "demo")
    return out, outside


def test_kiln_index_refuses_a_symlinked_directory_under_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, outside = _linked_out(tmp_path)
    make_wheel(tmp_path / "wheels", "demo", "1.0")
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(out / "demo") in err and "symbolic link" in err, err
    assert list(outside.iterdir()) == [] and (out / "index.html").read_text() == "old"


def test_kiln_index_from_a_list_refuses_a_symlinked_directory_under_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, outside = _linked_out(tmp_path)
    listing = tmp_path / "list.jsonl"
    listing.write_text(json.dumps({"filename": "demo-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1,
                                   "upload_time": 0}) + "\n")
    assert index_command(None, str(listing), str(out)) == EXIT_USAGE
    assert str(out / "demo") in capsys.readouterr().err
    assert list(outside.iterdir()) == [] and (out / "index.html").read_text() == "old"


def test_a_symlinked_page_file_under_out_is_refused_not_followed(tmp_path: Path) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside"
    make_wheel(tmp_path / "wheels", "demo", "1.0")
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_OK
    target = outside / "victim"
    outside.mkdir()
    target.write_text("keep")
    (out / "demo" / "index.html").unlink()
    os.symlink(target, out / "demo" / "index.html")
    make_wheel(tmp_path / "wheels", "demo", "1.1")
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_USAGE
    assert target.read_text() == "keep" and not (out / "demo" / "demo-1.1-py3-none-any.whl").exists()


def test_the_local_store_never_writes_through_a_link_below_its_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_immutable("a/x.whl", b"x", "application/octet-stream", "")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "store" / "b")
    with pytest.raises(UnsafePathError, match=str(tmp_path / "store" / "b")):
        store.put_immutable("b/y.whl", b"y", "application/octet-stream", "")
    with pytest.raises(UnsafePathError):
        store.put_page("b/index.html", b"page", "text/html", "", None)
    assert list((tmp_path / "outside").iterdir()) == []


def test_the_local_store_reads_a_link_only_while_it_stays_inside_the_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_immutable("a/x.whl", b"x", "application/octet-stream", "")
    (tmp_path / "secret").write_text("secret")
    os.symlink(tmp_path / "store" / "a" / "x.whl", tmp_path / "store" / "a" / "inside.whl")
    os.symlink(tmp_path / "secret", tmp_path / "store" / "a" / "leaves.whl")
    assert store.get("a/inside.whl") == b"x"
    with pytest.raises(UnsafePathError, match="outside the store"):
        store.get("a/leaves.whl")


# --- non-finite and absurd numbers in --from-list ------------------------------------------------------

_GOOD = {"filename": "demo-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0}


@pytest.mark.parametrize("field, value", [
    ("size", "Infinity"), ("size", "-Infinity"), ("size", "NaN"), ("size", "-1"), ("size", "1e300"),
    ("size", str(1 << 64)), ("upload_time", "NaN"), ("upload_time", "Infinity"), ("upload_time", "1e20"),
    ("upload_time", str(10**15)),
])
def test_non_finite_or_absurd_numbers_in_a_list_are_input_errors_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str) -> None:
    good = json.dumps(_GOOD)
    bad = good.replace(f'"{field}": {_GOOD[field]}', f'"{field}": {value}')
    assert bad != good
    listing = tmp_path / "list.jsonl"
    listing.write_text(f"{good}\n{bad}\n")
    assert index_command(None, str(listing), str(tmp_path / "out")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{listing}:2" in err and field in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
