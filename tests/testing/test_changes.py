"""kiln.tasks.testing.changes: --changed-since against a real git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.project.config import load_config
from kiln.tasks.testing.changes import changed_files, select_suites, suites_to_run

KILN_TOML = """
[project]
package = "pkg"
distribution = "pkg"
version = "1.0"
source = "pkg"
registry = "pkg.registry:registry"

[[variants]]
name = "cpu"
backend = "cpu"

[[suites]]
name = "kernels"
paths = ["tests/kernels"]
depends = ["pkg/kernels/"]

[[suites]]
name = "io"
paths = ["tests/io"]
depends = ["pkg/io.py"]

[publish]
default_target = "local"
[publish.targets.local]
url = "file://{out}/index"
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def repo(tmp_path):
    for path in ("pkg/kernels/add.py", "pkg/io.py", "tests/kernels/test_add.py", "tests/io/test_io.py", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# v1\n")
    (tmp_path / "kiln.toml").write_text(KILN_TOML)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return tmp_path


def _selected(repo: Path, *touched: str) -> list[str]:
    for path in touched:
        (repo / path).write_text("# v2\n")
    return [s.name for s in suites_to_run(load_config(repo / "kiln.toml"), None, "HEAD")]


def test_nothing_changed_selects_nothing(repo):
    assert _selected(repo) == []


def test_a_dependency_change_selects_only_its_suite(repo):
    assert _selected(repo, "pkg/kernels/add.py") == ["kernels"]


def test_a_suite_own_test_change_selects_it(repo):
    assert _selected(repo, "tests/io/test_io.py") == ["io"]


def test_an_unrelated_change_selects_nothing(repo):
    assert _selected(repo, "README.md") == []


@pytest.mark.parametrize("build_file", ["kiln.toml", "pyproject.toml"])
def test_config_or_build_file_change_selects_everything(repo, build_file):
    path = repo / build_file
    path.write_text(path.read_text() + "\n# touched\n") if path.exists() else path.write_text("[project]\n")
    git(repo, "add", build_file)  # a new file shows in the diff only once tracked
    assert [s.name for s in suites_to_run(load_config(repo / "kiln.toml"), None, "HEAD")] == ["kernels", "io"]


def test_names_and_changes_combine(repo):
    (repo / "pkg/io.py").write_text("# v2\n")
    config = load_config(repo / "kiln.toml")
    assert [s.name for s in suites_to_run(config, ["kernels"], "HEAD")] == []
    assert [s.name for s in suites_to_run(config, ["io"], "HEAD")] == ["io"]


def test_prefix_match_respects_path_boundaries(repo):
    config = load_config(repo / "kiln.toml")
    selected, reasons = select_suites(config, ["pkg/kernels_old/x.py", "pkg/io.pyc"])
    assert selected == []
    assert reasons["kernels"] == "left out: none of its dependencies changed"


@pytest.mark.parametrize("ref", ["no-such-branch", "--output=/tmp/x", "", "HEAD; rm -rf /"])
def test_bad_refs_are_refused_with_the_ref_named(repo, ref):
    with pytest.raises(InvalidInputError, match="changed-since|git revision"):
        changed_files(ref, repo)


def test_unknown_suite_name_is_refused(repo):
    with pytest.raises(InvalidInputError, match=r"unknown suite\(s\) \['kernel'\]"):
        suites_to_run(load_config(repo / "kiln.toml"), ["kernel"], None)


def test_git_gets_a_timeout(repo):
    seen = {}

    def runner(cmd, **kwargs):  # fault injection: a git that hangs past its timeout
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    with pytest.raises(InvalidInputError, match="did not finish in 5s"):
        changed_files("HEAD", repo, runner=runner, timeout=5)
    assert seen["timeout"] == 5


def test_select_all_in_kiln_toml_names_the_files_that_select_every_suite(repo):
    config_path = repo / "kiln.toml"
    config_path.write_text(config_path.read_text() + '\n[testing]\nselect_all = ["README.md", "tools/"]\n')
    git(repo, "commit", "-qam", "select_all")
    assert _selected(repo, "README.md") == ["kernels", "io"]
    git(repo, "checkout", "-q", "README.md")
    (repo / "tools").mkdir()
    (repo / "tools" / "gen.py").write_text("x\n")
    git(repo, "add", "tools")
    assert _selected(repo) == ["kernels", "io"]


def test_a_conftest_outside_select_all_selects_by_its_suite_only(repo):
    (repo / "tests" / "conftest.py").write_text("# top\n")
    git(repo, "add", "tests/conftest.py")
    assert _selected(repo) == []  # tests/conftest.py is no longer hard-coded; kiln.toml names what selects all
