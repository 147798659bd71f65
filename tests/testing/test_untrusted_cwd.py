"""Nothing runs from an untrusted directory: modules planted where ``kiln`` runs are never imported.

A user who can write a shared working directory (or the project root a kiln
command runs in) plants ``json.py`` (a standard library name: the worker and
Kiln's environment checks import ``json``) and ``probe_pkg.py`` (the name of the
package the wheel under test installs). Each writes a marker file when
imported. Kiln's helper interpreters — the environment checks of
``kiln.tasks.testing.envs`` and the test worker, forking or spawning — run with
``-P`` or a fixed directory, so no marker may appear, and the tests import the
installed wheel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.testing import envs
from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.runner import run_tests
from tests.helpers.wheelkit import make_wheel

pytestmark = pytest.mark.slow

PLANTED = ("json", "probe_pkg")
TEST_FILE = """
import json

import probe_pkg


def test_the_installed_wheel_is_imported():
    assert probe_pkg.PAYLOAD == "from-the-wheel", probe_pkg.__file__
    assert json.dumps([1]) == "[1]"
"""


def _plant(directory: Path, markers: Path) -> None:
    for name in PLANTED:
        marker = markers / f"{name}-from-{directory.name}"
        (directory / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\nPAYLOAD = 'planted'\n")


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_modules_planted_in_the_working_directory_are_never_imported(tmp_path, monkeypatch, start):
    markers, shared, project = tmp_path / "markers", tmp_path / "shared", tmp_path / "project"
    for directory in (markers, shared, project / "tests"):
        directory.mkdir(parents=True)
    (project / "tests" / "test_probe.py").write_text(TEST_FILE)
    _plant(shared, markers)   # the directory the kiln command runs in
    _plant(project, markers)  # and the project root, where the test worker runs
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg", payload="from-the-wheel")
    monkeypatch.chdir(shared)

    env = envs.make_env(tmp_path / "env", [wheel])
    results = run_tests(["tests"], project, tmp_path / "work",
                        RunOptions(python=str(env.python), start=start, preload=(), gpus=0, retries=0))

    assert [(r.nodeid, r.outcome) for r in results] == [
        ("tests/test_probe.py::test_the_installed_wheel_is_imported", "passed")], results[0].details
    assert sorted(p.name for p in markers.iterdir()) == []
