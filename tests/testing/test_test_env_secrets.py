"""The tests run the package's code: they never see the step's credentials, so they cannot write the
artifact store (outcomes, the quarantine list, history) that Kiln's step process alone writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.runner import run_tests

TEST_FILE = """
import json
import os
from pathlib import Path


def test_writes_what_it_sees():
    Path(os.environ["KILN_SEEN"]).write_text(json.dumps(sorted(os.environ)))
"""


def test_a_test_process_sees_no_cloud_or_prefect_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "test_env.py").write_text(TEST_FILE)
    seen = tmp_path / "work" / "seen.json"  # the sandboxed test writes only under its work folder
    secrets = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PREFECT_API_KEY", "GITHUB_TOKEN",
               "TWINE_PASSWORD", "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL")
    for name in secrets:
        monkeypatch.setenv(name, "the step's secret")
    monkeypatch.setenv("KILN_SEEN", str(seen))
    monkeypatch.setenv("SOME_UNLISTED_SETTING", "not the tests' business")
    (result,) = run_tests(["tests/test_env.py"], project, tmp_path / "work",
                          RunOptions(preload=(), pass_env=("KILN_SEEN",)))
    assert result.outcome == "passed", result.message
    names = json.loads(seen.read_text())
    assert "KILN_SEEN" in names and "PATH" in names  # what the suite names, and the allow-list, are passed on
    assert "SOME_UNLISTED_SETTING" not in names  # an allow-list: the rest of the step's environment is not
    assert not [n for n in names if n in secrets or n.startswith(("AWS_", "PREFECT_"))]
