"""Which file a resolution takes for each name: a name the Kiln index holds must be one of its files, by content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.release.install.installer import pip_steps
from kiln.release.install.provenance import Chosen, foreign, read_report, sdist_only

KILN, EVIL = "http://127.0.0.1:8000/nightly/cpu/simple/", "http://127.0.0.1:9000/simple/"
HELD = {"kiln-runtime": frozenset({"a" * 64}), "kiln-kernels": frozenset({"b" * 64})}


@pytest.mark.parametrize(("chosen", "problem"), [
    (Chosen("kiln-runtime", "0.1.0", f"{KILN}kiln-runtime/kiln_runtime-0.1.0-py3-none-any.whl", "a" * 64), None),
    (Chosen("helper", "1.0", f"{EVIL}helper/helper-1.0-py3-none-any.whl", "c" * 64), None),  # not held: anywhere
    (Chosen("kiln-runtime", "99.0", f"{EVIL}kiln-runtime/kiln_runtime-99.0-py3-none-any.whl", "d" * 64),
     f"kiln-runtime 99.0 would come from {EVIL}kiln-runtime/kiln_runtime-99.0-py3-none-any.whl ({EVIL})"),
    (Chosen("kiln-kernels", "1.0", "https://elsewhere.example/k/kiln_kernels-1.0-cp311-cp311-linux_x86_64.whl", ""),
     "(an index other than the Kiln index), not from the Kiln index"),  # no hash is never Kiln's
])
def test_a_held_name_is_kilns_only_when_its_file_is_one_the_kiln_index_lists(chosen, problem):
    found = foreign([chosen], KILN, HELD, [KILN, EVIL])
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found


def test_pips_report_is_read_and_a_broken_one_is_named(tmp_path: Path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": "Kiln_Runtime", "version": "0.1.0"},
                                               "download_info": {"url": "u", "archive_info": {"hash": "sha256=ab"}}}]}))
    assert read_report(report) == [Chosen("kiln-runtime", "0.1.0", "u", "ab")]
    report.write_text("{not json")
    with pytest.raises(InvalidInputError, match=str(report)):
        read_report(report)


def test_the_skipped_sdists_of_a_wheels_only_resolution_are_named_once():
    log = ("  Skipping link: No sources permitted for Evil_Sdist: file:///x/evil_sdist-1.0.tar.gz\n"
           "  Skipping link: No sources permitted for evil-sdist: file:///x/evil_sdist-1.1.tar.gz\n"
           "  Skipping link: none of the wheel's tags (cp39) are compatible: file:///x/other.whl\n")
    assert sdist_only(log) == ["evil-sdist"]


def test_pip_takes_the_held_names_from_the_kiln_index_alone_before_it_resolves_the_rest():
    assert pip_steps(KILN, "k==1", ["rt==0.1"], [EVIL]) == [
        ["--index-url", KILN, "--no-deps", "k==1", "rt==0.1"],
        ["--index-url", KILN, "--extra-index-url", EVIL, "k==1"]]
    assert pip_steps(KILN, "k==1", ["rt==0.1"]) == [["--index-url", KILN, "k==1"]]  # one index: nothing to shadow it
