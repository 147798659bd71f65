"""Interpreter discovery runs only what it may: no program from the working directory or the project tree,
every probe with a minimal environment, and no claimed version its name contradicts.

Real processes: each candidate is a small shell script that leaves a marker when it runs, so "never run"
is the marker's absence, not a mock's call count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.tasks.build.interpreters import EXPLICIT, find_interpreter

SYSTEM = "/usr/bin:/bin"
SECRETS = {"AWS_SECRET_ACCESS_KEY": "aws-secret", "PREFECT_API_KEY": "prefect-key", "GITHUB_TOKEN": "gh-token",
           "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "oidc-token", "TWINE_PASSWORD": "twine-password"}


def _planted(path: Path, minor: str, marker: Path) -> Path:
    """A would-be interpreter that claims CPython ``minor``, and writes its environment to ``marker`` if run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n"
                    f"{{ pwd; env; }} > '{marker}'\n"
                    f"echo 'KILN-PY [\"cpython\", \"{minor}\", \"{minor}.0\", \"{path}\"]'\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("path", [f"{SYSTEM}:", f"{SYSTEM}::/nonexistent", f":{SYSTEM}", f"bin:{SYSTEM}",
                                  f"./bin:{SYSTEM}"],
                         ids=["trailing-colon", "empty-entry", "leading-colon", "relative", "dot-relative"])
def test_a_planted_python_in_the_working_directory_is_never_run(tmp_path, monkeypatch, path):
    work, project = tmp_path / "work", tmp_path / "project"
    project.mkdir()
    marker = tmp_path / "planted-ran"
    for planted in (work / "python3.12", work / "bin" / "python3.12"):
        _planted(planted, "3.12", marker)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", path)  # the shell's PATH too: a program named without a directory is looked up there

    found, tried = find_interpreter("3.12", {}, project, environ={"PATH": path, "HOME": os.environ.get("HOME", "/")})

    assert not marker.exists(), marker.read_text()
    assert found is None or not found.path.resolve().is_relative_to(work), found


def test_a_python_in_the_project_tree_runs_only_when_the_interpreters_table_names_it(tmp_path):
    project = tmp_path / "project"
    marker = tmp_path / "venv-python-ran"
    venv_python = _planted(project / ".venv" / "bin" / "python3.99", "3.99", marker)
    environ = {"PATH": f"{venv_python.parent}:{SYSTEM}", "HOME": str(tmp_path / "home")}

    found, tried = find_interpreter("3.99", {}, project, environ=environ)

    assert found is None and not marker.exists()
    assert any(f"PATH: {venv_python} lies in the project tree" in line and "[build.interpreters]" in line
               for line in tried), tried
    found, _ = find_interpreter("3.99", {"3.99": ".venv/bin/python3.99"}, project, environ=environ)
    assert found is not None and found.path == venv_python and found.found_by == EXPLICIT and marker.exists()


def test_a_probe_runs_with_a_minimal_environment_in_a_scratch_directory(tmp_path, monkeypatch):
    marker = tmp_path / "probe-env"
    candidate = _planted(tmp_path / "machine" / "bin" / "python3.99", "3.99", marker)
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    environ = {"PATH": f"{candidate.parent}::relative:{SYSTEM}", "HOME": str(home), "LANG": "C.UTF-8", **SECRETS}

    found, _ = find_interpreter("3.99", {}, tmp_path / "project", environ=environ)

    assert found is not None and found.path == candidate and found.found_by == "PATH"
    cwd, *lines = marker.read_text().splitlines()
    seen = dict(line.split("=", 1) for line in lines if "=" in line)
    assert not set(SECRETS) & set(seen) and not set(SECRETS.values()) & set(seen.values()), seen
    assert seen["HOME"] != str(home) and seen["HOME"] == seen["TMPDIR"] == cwd  # a scratch directory, not the user's
    assert seen["PATH"] == f"{candidate.parent}:{SYSTEM}" and seen["LANG"] == "C.UTF-8"
    assert not Path(cwd).exists()  # the scratch is gone once the probe answered


def test_a_candidate_whose_name_promises_another_version_is_not_believed(tmp_path):
    marker = tmp_path / "liar-ran"
    liar = _planted(tmp_path / "bin" / "python3.98", "3.99", marker)  # named 3.98, claims 3.99

    found, tried = find_interpreter("3.99", {"3.99": str(liar)}, tmp_path / "project",
                                    environ={"PATH": SYSTEM, "HOME": str(tmp_path)})

    assert found is None and not marker.exists()
    assert f"{EXPLICIT}: {liar} is named for Python 3.98, not 3.99" in tried, json.dumps(tried)
