"""kiln index / kiln verify as plain functions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.core.fsutil import sha256_bytes, sha256_file
from kiln.core.store import LocalStore
from kiln.release.cli import EXIT_OK, EXIT_USAGE, index_command, verify_command
from kiln.release.read.serve import IndexServer
from tests.helpers.indexcheck import check_local_index
from tests.helpers.wheelkit import make_wheel


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_index_from_wheel_dir_is_self_contained_and_checks_out(tmp_path: Path, capsys) -> None:
    for version in ("1.0+cu130", "1.1+cu130"):
        make_wheel(tmp_path / "wheels", "kiln-kernels", version)
    assert index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out")) == EXIT_OK
    report = check_local_index(tmp_path / "out")
    assert report.problems == [] and len(report.files) == 2
    assert "2 files, 1 projects" in capsys.readouterr().out


def test_index_rerun_with_one_new_wheel_rewrites_only_that_project(tmp_path: Path) -> None:
    make_wheel(tmp_path / "wheels", "alpha", "1.0")
    make_wheel(tmp_path / "wheels", "beta", "1.0")
    index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out"))
    before = _mtimes(tmp_path / "out")
    make_wheel(tmp_path / "wheels", "beta", "2.0")
    index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out"))
    after = _mtimes(tmp_path / "out")
    changed = sorted(k for k in before if after[k] != before[k])
    assert changed == ["beta/index.html", "beta/index.json"]


def _line(**kw) -> str:
    record = {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 10, "upload_time": 1.7e9}
    return json.dumps({**record, **kw}) + "\n"


def test_index_from_list_writes_pages_only(tmp_path: Path) -> None:
    (tmp_path / "list.jsonl").write_text(_line() + _line(filename="q-2.0+cu130-py3-none-any.whl", yanked="bad"))
    assert index_command(None, str(tmp_path / "list.jsonl"), str(tmp_path / "out")) == EXIT_OK
    assert sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file()) == [
        "index.html", "index.json", "p/index.html", "p/index.json", "q/index.html", "q/index.json"]


@pytest.mark.parametrize("bad", [_line(filename="../p-1.0-py3-none-any.whl"), _line(sha256="nothex"), "{not json\n",
                                 _line(filename="p-1.0-py3-none-any.whl\u0007")])
def test_index_from_bad_list_fails_naming_the_line_and_writes_nothing(tmp_path: Path, capsys, bad: str) -> None:
    (tmp_path / "list.jsonl").write_text(_line(filename="ok-1.0-py3-none-any.whl") + bad)
    assert index_command(None, str(tmp_path / "list.jsonl"), str(tmp_path / "out")) == EXIT_USAGE
    assert "list.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_index_refuses_to_replace_a_wheel_with_other_bytes(tmp_path: Path) -> None:
    make_wheel(tmp_path / "w1", "alpha", "1.0", payload="one")
    index_command(str(tmp_path / "w1"), None, str(tmp_path / "out"))
    original = sha256_file(tmp_path / "out" / "alpha" / "alpha-1.0-py3-none-any.whl")
    make_wheel(tmp_path / "w2", "alpha", "1.0", payload="two")
    assert index_command(str(tmp_path / "w2"), None, str(tmp_path / "out")) != EXIT_OK
    assert sha256_file(tmp_path / "out" / "alpha" / "alpha-1.0-py3-none-any.whl") == original


@pytest.mark.parametrize("source", ["wheels", "list"])
def test_index_out_is_written_owner_only_unless_public(tmp_path: Path, source: str) -> None:
    make_wheel(tmp_path / "wheels", "alpha", "1.0")
    (tmp_path / "list.jsonl").write_text(_line())
    args = (str(tmp_path / "wheels"), None) if source == "wheels" else (None, str(tmp_path / "list.jsonl"))
    assert index_command(*args, str(tmp_path / "out")) == EXIT_OK
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700
    assert index_command(*args, str(tmp_path / "served"), public=True) == EXIT_OK
    assert (tmp_path / "served").stat().st_mode & 0o755 == 0o755  # readable and searchable by all


@pytest.mark.parametrize("mode", [0o775, 0o777])
def test_index_out_others_may_write_into_is_refused_naming_it_unless_public(tmp_path: Path, capsys,
                                                                            mode: int) -> None:
    make_wheel(tmp_path / "wheels", "alpha", "1.0")
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, mode)
    assert index_command(str(tmp_path / "wheels"), None, str(out)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"kiln index --out {out} is refused: its group or every user may write into it (mode {mode:04o})" in err
    assert "--public" in err and list(out.iterdir()) == []  # nothing written
    assert index_command(str(tmp_path / "wheels"), None, str(out), public=True) == EXIT_OK


def test_index_needs_exactly_one_source(tmp_path: Path) -> None:
    assert index_command(None, None, str(tmp_path)) == EXIT_USAGE
    assert index_command("a", "b", str(tmp_path)) == EXIT_USAGE


def test_verify_command_without_install_reports_ok_then_a_tampered_file(tmp_path: Path, capsys) -> None:
    make_wheel(tmp_path / "wheels", "alpha", "1.0+cu130")
    index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out"))
    with IndexServer(LocalStore(tmp_path / "out")) as server:
        assert verify_command(server.url, install=False) == EXIT_OK
        (tmp_path / "out" / "alpha" / "alpha-1.0+cu130-py3-none-any.whl").write_bytes(b"tampered")
        assert verify_command(server.url, install=False) != EXIT_OK
    assert "sha256 or size does not match" in capsys.readouterr().out


def test_verify_command_names_an_altered_sidecar_and_both_its_hashes(tmp_path: Path, capsys) -> None:
    make_wheel(tmp_path / "wheels", "alpha", "1.0+cu130")
    index_command(str(tmp_path / "wheels"), None, str(tmp_path / "out"))
    sidecar = tmp_path / "out" / "alpha" / "alpha-1.0+cu130-py3-none-any.whl.metadata"
    advertised = sha256_bytes(sidecar.read_bytes())
    altered = sidecar.read_bytes().replace(b"Version: 1.0+cu130", b"Version: 9.9")
    sidecar.write_bytes(altered)
    with IndexServer(LocalStore(tmp_path / "out")) as server:
        assert verify_command(server.url, install=False) != EXIT_OK
    problems = [line for line in capsys.readouterr().out.splitlines() if "problem:" in line]
    # one problem per form of the page that advertises the sidecar (HTML and PEP 691 JSON)
    assert len(problems) == 2 and {"HTML", "JSON"} == {f for p in problems for f in ("HTML", "JSON") if f" {f} " in p}
    for problem in problems:
        assert sidecar.name in problem and advertised in problem and sha256_bytes(altered) in problem, problem


def test_a_line_holding_two_json_values_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "list.jsonl").write_text(_line() + "\n" + _line().strip() + ", 3\n")
    assert index_command(None, str(tmp_path / "list.jsonl"), str(tmp_path / "out")) == EXIT_USAGE
    assert "list.jsonl:3" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_every_error_carries_the_exit_status_both_command_lines_use() -> None:
    """One table (kiln.core.errors): bad input exits 2, every other Kiln error 1, in `kiln` and `kiln index`."""
    from kiln.core import errors

    def subclasses(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in subclasses(sub))]

    for cls in subclasses(errors.KilnError):
        expected = errors.EXIT_USAGE if issubclass(cls, errors.InvalidInputError) else errors.EXIT_FAILED
        assert cls.exit_status == expected, cls
    assert errors.ConfigError.exit_status == errors.UnsafePathError.exit_status == EXIT_USAGE


def test_kiln_index_public_accepts_a_shared_output_the_plain_command_refuses(tmp_path: Path, capsys) -> None:
    from kiln.flows.cli import main

    make_wheel(tmp_path / "wheels", "alpha", "1.0")
    out = tmp_path / "served"
    out.mkdir()
    os.chmod(out, 0o775)  # a team's directory its web server reads
    assert main(["index", str(tmp_path / "wheels"), "--out", str(out)]) == EXIT_USAGE
    assert f"{out} is refused" in capsys.readouterr().err and list(out.iterdir()) == []
    assert main(["index", str(tmp_path / "wheels"), "--out", str(out), "--public"]) == EXIT_OK
    assert check_local_index(out).problems == []
