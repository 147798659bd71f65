"""``kiln bench --results FILE``: the results file's flag; ``--out FILE`` stays for a release, with a warning."""

import pytest

from kiln.flows.cli import build_parser


def test_results_names_the_results_file_without_a_warning(capsys):
    ns = build_parser().parse_args(["bench", "--results", "r.json"])
    assert ns.results_path == "r.json"
    assert capsys.readouterr().err == ""


def test_the_old_out_spelling_still_works_and_names_the_new_flag(capsys):
    ns = build_parser().parse_args(["bench", "--out", "r.json"])
    assert ns.results_path == "r.json"
    err = capsys.readouterr().err
    assert "--out is deprecated" in err and "use --results" in err


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--run-dir", "d"]])
def test_without_either_flag_no_results_file_is_written(argv):
    assert build_parser().parse_args(argv).results_path is None
