"""Index pages stay byte-identical to the ones the generator wrote before it was made fast.

``fixtures/golden/index/`` holds the pages that ``kiln index --from-list`` wrote
for ``fixtures/golden/list.jsonl`` (every optional field: yanked with and
without a reason, Requires-Python, metadata hashes, sdists, odd names, epochs,
local versions, duplicates) at commit fe15310, when every JSON page went
through ``json.dumps`` and every file through a frozen dataclass, then
changed in one way only: API version 1.4 and PEP 792's ``active`` status
marker on every project page (issue 28; checked, when they were rewritten,
to be the fe15310 pages plus exactly those lines). The 100k benchmark index
is checked by digest only (``slow``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

from kiln.core import fsutil
from kiln.core.dists import from_record, from_records, make_distribution
from kiln.core.errors import InvalidInputError
from kiln.core.fsutil import journaled, write_new_tree
from kiln.release.cli import EXIT_OK, index_command, read_list
from kiln.release.index.render import file_url, generate, group, project_pages

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
# sha256 over (path NUL sha256-of-page) of every page of the benchmark's 100k list: fe15310's pages
# (55412cf2…) with API version 1.4 and the active status marker, each page checked against them (issue 28)
BENCH_100K_DIGEST = "664fa03d12aceca5eb1ae305792e0d0184db07f08f9de0205e43444d2e193015"


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_kiln_index_from_list_writes_the_golden_pages_byte_for_byte(tmp_path: Path) -> None:
    assert index_command(None, str(GOLDEN / "list.jsonl"), str(tmp_path / "out")) == EXIT_OK
    written, golden = _tree(tmp_path / "out"), _tree(GOLDEN / "index")
    assert sorted(written) == sorted(golden)
    for path, data in golden.items():
        assert written[path] == data, f"{path} differs from the golden page"


def test_an_update_in_place_also_gives_the_golden_pages(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)  # not empty: written page by page, not as a new tree
    assert index_command(None, str(GOLDEN / "list.jsonl"), str(out)) == EXIT_OK
    assert _tree(out) == _tree(GOLDEN / "index")


def _reference_json(project: str, dists) -> bytes:
    """The JSON page as the generator wrote it before (one json.dumps of the whole page)."""
    files = []
    for d in dists:
        entry = {"filename": d.filename, "url": file_url(d.filename), "hashes": {"sha256": d.sha256}, "size": d.size,
                 "upload-time": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(d.upload_time)),
                 "yanked": False if d.yanked is None else (d.yanked or True)}
        if d.requires_python:
            entry["requires-python"] = d.requires_python
        if d.metadata_sha256:
            entry["core-metadata"] = entry["dist-info-metadata"] = {"sha256": d.metadata_sha256}
        files.append(entry)
    data = {"meta": {"api-version": "1.4"}, "name": project, "files": files,
            "versions": sorted({d.version for d in dists}, key=Version), "project-status": {"status": "active"}}
    return (json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n").encode()


_text = st.text(st.characters(min_codepoint=0x20, blacklist_categories=("Cs",), blacklist_characters="\x7f"),
                max_size=12)
_hex = st.text("0123456789abcdef", min_size=64, max_size=64)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a-1.0-py3-none-any.whl", "a-2.0+cu130-py3-none-any.whl",
                                           "A.b-1.0.tar.gz", "a-1!3.0rc1.zip", "a-0.9-1-cp311-abi3-win_amd64.whl"]),
                          _hex, st.integers(0, 2**63), st.integers(0, 4102444800),
                          st.sampled_from([None, "", ">=3.10", "!=3.11.*,<4", "~=3.8"]), st.none() | _hex,
                          st.none() | _text), min_size=1, max_size=5, unique_by=lambda e: e[0]))
def test_written_out_json_equals_json_dumps_for_any_field_values(entries) -> None:
    dists = [make_distribution(*entry) for entry in entries]
    for project, files in group(dists).items():
        assert project_pages(project, files)[f"{project}/index.json"] == _reference_json(project, files)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 253402300799))  # up to 9999-12-31T23:59:59
def test_upload_time_iso_equals_strftime(seconds: int) -> None:
    dist = make_distribution("a-1.0-py3-none-any.whl", "a" * 64, 1, seconds)
    assert dist.upload_time_iso == time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(seconds))


def _golden_records() -> list[dict]:
    return [json.loads(line) for line in (GOLDEN / "list.jsonl").read_text().splitlines()]


_BAD = [
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "A" * 64, "size": 1, "upload_time": 0},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": True, "upload_time": 0},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": -1},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0, "metadata_sha256": "b"},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0, "yanked": "a\x07b"},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0, "requires_python": "3"},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0, "extra": 1},
    {"filename": ".p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0},
    {"filename": "p-1.x-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0},
    {"filename": "p__q-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1, "upload_time": 0},
    {"filename": "p-1.0-py3-none-any.whl", "sha256": "a" * 64, "size": 1},
    ["not", "an", "object"],
]


def test_bulk_records_give_what_one_record_gives() -> None:
    records = _golden_records() + [dict(r, size=float(r["size"]), upload_time=r["upload_time"] + 0.5)
                                   for r in _golden_records()]
    assert from_records(records, str) == [from_record(r) for r in records]


@pytest.mark.parametrize("record", _BAD, ids=range(len(_BAD)))
def test_bulk_records_refuse_what_one_record_refuses_with_the_same_message(record) -> None:
    with pytest.raises(InvalidInputError) as one:
        from_record(record, "list.jsonl:7")
    with pytest.raises(InvalidInputError) as bulk:
        from_records([_golden_records()[0], record], lambda i: f"list.jsonl:{i + 6}")
    assert str(bulk.value) == str(one.value)


@pytest.mark.parametrize("layout", ["blank lines", "crlf", "no final newline", "spaces around"])
def test_a_list_reads_the_same_however_its_lines_are_laid_out(tmp_path: Path, layout: str) -> None:
    lines = (GOLDEN / "list.jsonl").read_text().splitlines()
    text = {"blank lines": "\n\n".join(lines) + "\n\n", "crlf": "\r\n".join(lines) + "\r\n",
            "no final newline": "\n".join(lines), "spaces around": "".join(f"  {line} \n" for line in lines)}[layout]
    (tmp_path / "list.jsonl").write_text(text, newline="")
    assert read_list(tmp_path / "list.jsonl") == read_list(GOLDEN / "list.jsonl")


def test_a_bad_record_after_blank_lines_is_named_by_its_line(tmp_path: Path) -> None:
    good = (GOLDEN / "list.jsonl").read_text().splitlines()[0]
    (tmp_path / "list.jsonl").write_text(f"{good}\n\n{good.replace('.whl', '.exe')}\n")
    with pytest.raises(InvalidInputError, match=r"list\.jsonl:3"):
        read_list(tmp_path / "list.jsonl")


def test_a_new_tree_appears_whole_with_the_modes_of_plain_writes(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "out"
    assert write_new_tree(out, {"index.html": b"root", "p/index.html": b"page"})
    assert _tree(out) == {"index.html": b"root", "p/index.html": b"page"}
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777, (out / "p").stat().st_mode & 0o777) == (0o777 & ~umask,) * 2
    assert (out / "p" / "index.html").stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporary directory left


def test_a_new_tree_is_not_written_over_a_directory_that_holds_something(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine").write_bytes(b"x")
    assert not write_new_tree(tmp_path / "out", {"index.html": b"root"})
    assert _tree(tmp_path / "out") == {"mine": b"x"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_tree_that_loses_the_race_for_its_directory_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    real_rename = os.rename

    def another_writer_first(src, dst):  # fault injection: someone fills ``out`` just before our rename
        (Path(dst) / "theirs").parent.mkdir(parents=True, exist_ok=True)
        (Path(dst) / "theirs").write_bytes(b"t")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", another_writer_first)
    assert not write_new_tree(tmp_path / "out", {"index.html": b"root"})
    assert _tree(tmp_path / "out") == {"theirs": b"t"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("rel", ["../x", "/abs", "a//b", "./a"])
def test_a_new_tree_refuses_paths_outside_it(tmp_path: Path, rel: str) -> None:
    with pytest.raises(InvalidInputError):
        write_new_tree(tmp_path / "out", {rel: b"x"})
    assert not (tmp_path / "out").exists()


def test_a_new_tree_with_nested_directories_is_written_whole(tmp_path: Path) -> None:
    files = {"x": b"1", "a/b/c": b"2", "a/d": b"3", "e/f/g/h": b"4", "a/b/i": b""}
    assert write_new_tree(tmp_path / "out", files)
    assert _tree(tmp_path / "out") == files


def test_a_new_tree_keeps_every_byte_when_the_kernel_writes_a_little_at_a_time(tmp_path: Path, monkeypatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))  # short writes, as allowed
    files = {"index.html": bytes(range(256)) * 40, "p/index.json": b"{}" * 1000}
    assert write_new_tree(tmp_path / "out", files)
    assert _tree(tmp_path / "out") == files


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_TOPDIR_FL = 0x80006601, 0x40006602, 0x00020000  # linux/fs.h


def _ioctl_flags(path: Path, set_flags: int | None = None) -> int | None:
    """``lsattr`` of a directory (or ``chattr`` with ``set_flags``); None where the filesystem refuses."""
    import fcntl
    import struct

    size = struct.calcsize("l") << 16  # _IOR/_IOW('f', n, long)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if set_flags is not None:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS | size, struct.pack("i", set_flags) + bytes(4))
        buffer = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS | size, buffer)
        return struct.unpack_from("i", buffer)[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def test_a_new_tree_asks_an_ext4_without_journal_to_spread_its_project_directories(tmp_path: Path) -> None:
    (tmp_path / "probe").mkdir()
    if not (_ioctl_flags(tmp_path / "probe", _FS_TOPDIR_FL) or 0) & _FS_TOPDIR_FL:
        pytest.skip(f"{tmp_path} is not on ext2/3/4: no FS_TOPDIR_FL to set")
    assert write_new_tree(tmp_path / "out", {"p/index.html": b"page"})
    hinted = bool((_ioctl_flags(tmp_path / "out") or 0) & _FS_TOPDIR_FL)
    assert hinted == (journaled(str(tmp_path)) is False), "chattr +T on the new tree exactly where there is no journal"


@pytest.mark.parametrize(("journals", "expected"), [(["vda-8"], True), (["vda1-8", "dm-0-8"], False), ([], False),
                                                    (None, False)])
def test_a_journal_is_found_by_the_device_of_the_path(tmp_path: Path, journals: list[str] | None,
                                                      expected: bool) -> None:
    st = os.stat(tmp_path)
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    (sysfs / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to("../devices/virtio1/block/vda")
    jbd2 = tmp_path / "jbd2"
    if journals is not None:  # None: no jbd2 directory at all (no journal on the machine)
        jbd2.mkdir()
        for name in journals:
            (jbd2 / name).mkdir()
    assert journaled(str(tmp_path), str(sysfs), str(jbd2)) is expected


def test_a_path_on_no_block_device_has_no_journal_to_speak_of(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()  # no major:minor entry for the path's device
    assert journaled(str(tmp_path), str(tmp_path / "sys"), str(tmp_path / "jbd2")) is None


def test_a_filesystem_that_refuses_the_spreading_hint_still_gets_the_whole_tree(tmp_path: Path, monkeypatch) -> None:
    import errno
    import fcntl

    def refuse(*_args: object) -> None:
        raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")

    monkeypatch.setattr(fsutil, "journaled", lambda _path: False)  # ask, whatever this machine's disk
    monkeypatch.setattr(fcntl, "ioctl", refuse)
    assert index_command(None, str(GOLDEN / "list.jsonl"), str(tmp_path / "out")) == EXIT_OK
    assert _tree(tmp_path / "out") == _tree(GOLDEN / "index")


def _bench_records(files: int = 100_000, projects: int = 2_000) -> list[dict]:
    """benchmarks/bench_index.py's list at fe15310, frozen here with the digest above."""
    per_project, out = files // projects, []
    for p in range(projects):
        for v in range(per_project):
            n = p * per_project + v
            record = {"filename": f"proj_{p:04d}-1.{v}.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl",
                      "sha256": f"{n:064x}", "size": 1000 + n, "upload_time": 1_700_000_000 + n,
                      "requires_python": ">=3.10"}
            if v % 2 == 0:
                record["metadata_sha256"] = f"{n + 1:064x}"
            out.append(record)
    return out


@pytest.mark.slow
def test_the_100k_benchmark_index_has_the_bytes_it_had_before() -> None:
    pages = generate(from_records(_bench_records(), str))
    assert len(pages) == 4002 and _digest(pages) == BENCH_100K_DIGEST


def _digest(pages: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for path in sorted(pages):
        digest.update(path.encode() + b"\0" + hashlib.sha256(pages[path]).digest())
    return digest.hexdigest()


@pytest.mark.slow
def test_kiln_index_writes_the_100k_benchmark_index_with_the_bytes_it_had_before(tmp_path: Path) -> None:
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _bench_records()))
    assert index_command(None, str(tmp_path / "list.jsonl"), str(tmp_path / "out")) == EXIT_OK
    written = _tree(tmp_path / "out")
    assert len(written) == 4002 and _digest(written) == BENCH_100K_DIGEST
