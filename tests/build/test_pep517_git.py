"""pep517 builds see the project as its own build would: a clone with .git, so setuptools-scm finds its files;
and never Kiln's state (.kiln/, --out), so a second build of the same commit, default settings, is all hits."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.build.sources import copy_project, project_files, project_hash
from tests.helpers.gitrepo import FIXTURES, commit_all, git

pytestmark = pytest.mark.slow


def scm_repo(dest: Path) -> Path:
    """The scmpkg fixture committed in a fresh repository with no .gitignore: .kiln/ and out/ are not ignored."""
    repo = dest / "scmpkg"
    shutil.copytree(FIXTURES / "scmpkg", repo, ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q", "-b", "main")
    commit_all(repo, "scmpkg")
    git(repo, "tag", "v1.0.0")
    return repo


def _build(repo: Path):
    from kiln.flows.build import build_flow

    out = repo / "out"  # the default --out of a kiln command run in the project: inside it, not ignored
    state = build_flow(str(repo / "kiln.toml"), str(out), version="1.0.0.dev20261203", return_state=True)
    return state, RunManifest.load(out / str(state.state_details.flow_run_id))


@pytest.fixture(scope="module")
def two_builds(prefect_server, tmp_path_factory):
    repo = scm_repo(tmp_path_factory.mktemp("scm"))
    first = _build(repo)
    second = _build(repo)
    return repo, first, second


def _names(wheel: Path) -> tuple[set[str], set[str]]:
    """(the package's files, the dist-info's file names) of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    return ({n for n in names if ".dist-info/" not in n},
            {n.split("/", 1)[1] for n in names if ".dist-info/" in n})


def test_the_wheel_holds_every_file_a_plain_pip_wheel_of_the_checkout_holds(two_builds, tmp_path):
    repo, (state, run), _ = two_builds
    assert state.is_completed(), state.message
    kiln_wheel = run.root / next(a.path for a in run.artifacts_of("wheel"))
    plain = tmp_path / "plain"
    subprocess.run(["git", "clone", "-q", str(repo), str(plain)], check=True, timeout=60)
    dist = tmp_path / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(plain)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    plain_files, plain_info = _names(next(dist.glob("*.whl")))
    kiln_files, kiln_info = _names(kiln_wheel)
    assert {"scmpkg/data/table.json", "scmpkg/ops/experimental/fused.py"} <= plain_files  # from git's file list
    assert kiln_files == plain_files
    assert plain_info <= kiln_info and kiln_info - plain_info == {"kiln_build.json", "sboms/kiln.cdx.json"}  # Kiln's record and the SBOM


def test_a_second_build_of_the_same_commit_with_default_settings_is_all_cache_hits(two_builds):
    repo, (first, first_run), (second, second_run) = two_builds
    assert first.is_completed() and second.is_completed(), second.message
    builds = [u for u in second_run.units if u.id.endswith("/pep517")]
    assert builds and {u.cache for u in builds} == {"hit"}, [(u.id, u.cache) for u in builds]
    assert (repo / ".kiln").is_dir() and (repo / "out").is_dir()  # Kiln's state is there, untracked, not ignored
    names = project_files(repo, (repo / ".kiln" / "cache",))
    assert not [n for n in names if n.startswith((".kiln/", "out/"))]


def test_the_copy_is_a_clone_at_head_with_the_working_trees_changes(tmp_path):
    repo = scm_repo(tmp_path)
    (repo / "src" / "scmpkg" / "ops" / "__init__.py").write_text('"""Edited, not committed."""\n')
    (repo / "src" / "scmpkg" / "new.py").write_text("NEW = 1\n")
    (repo / "src" / "scmpkg" / "data" / "table.json").unlink()
    (repo / ".kiln" / "cache").mkdir(parents=True)
    (repo / ".kiln" / "cache" / "object").write_text("Kiln's own\n")
    before = project_hash(repo, (repo / ".kiln" / "cache",))
    copy = copy_project(repo, tmp_path / "copy", (repo / ".kiln" / "cache",))
    assert (copy / ".git").exists()
    assert (copy / "src" / "scmpkg" / "ops" / "__init__.py").read_text() == '"""Edited, not committed."""\n'
    assert (copy / "src" / "scmpkg" / "new.py").is_file() and not (copy / "src/scmpkg/data/table.json").exists()
    assert not (copy / ".kiln").exists()
    head = subprocess.run(["git", "-C", str(copy), "describe", "--tags"], capture_output=True, text=True, timeout=60)
    assert head.stdout.strip() == "v1.0.0"  # what setuptools-scm reads for the version
    (repo / ".kiln" / "cache" / "object").write_text("changed\n")
    assert project_hash(repo, (repo / ".kiln" / "cache",)) == before  # Kiln's state is not the project's
