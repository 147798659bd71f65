"""``-v``: a flow command prints a line per finished unit and the whole text summary instead of the one-screen
ending; commands that run no flow do not take it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.manifest import MANIFEST_NAME
from kiln.flows.cli.flowrun import _verbose, verbosity
from kiln.flows.cli.parser import build_parser
from kiln.flows.report.summary import print_summary, render_console, render_text
from tests.flows.test_console_summary import nightly_run


@pytest.mark.parametrize("command", ["nightly", "build", "test", "bench", "publish"])
def test_every_flow_command_takes_v(command):
    assert build_parser().parse_args([command, "-v"]).verbose is True
    assert build_parser().parse_args([command]).verbose is False


def test_a_command_that_runs_no_flow_refuses_v(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verify", "file:///x/", "-v"])
    assert "unrecognized arguments: -v" in capsys.readouterr().err


def test_the_whole_text_summary_with_v_and_the_one_screen_ending_without(tmp_path: Path, capsys):
    run = nightly_run(tmp_path)
    run.save()
    assert (run.root / MANIFEST_NAME).exists()
    print_summary(run.root)
    short = capsys.readouterr().out
    print_summary(run.root, full=True)
    full = capsys.readouterr().out
    assert short.rstrip("\n") == render_console(run) and full.rstrip("\n") == render_text(run)
    assert len(full.splitlines()) > len(short.splitlines())


def test_verbosity_holds_for_its_block_only():
    with verbosity(True):
        assert _verbose.get() is True
    assert _verbose.get() is False
