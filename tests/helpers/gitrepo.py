"""Fixture projects committed in real git repositories (a nightly publishes only a clean commit)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "projects"
GIT_ENV = {"GIT_AUTHOR_NAME": "Kiln Test", "GIT_AUTHOR_EMAIL": "kiln@example.invalid",
           "GIT_COMMITTER_NAME": "Kiln Test", "GIT_COMMITTER_EMAIL": "kiln@example.invalid"}
COMMIT_TIME = "2026-11-30T21:07:03+00:00"


def git(repo: Path, *args: str, when: str | None = None) -> str:
    env = {**os.environ, **GIT_ENV}
    if when:
        env |= {"GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, timeout=60,
                          check=True)
    return done.stdout.strip()


def commit_all(repo: Path, message: str, when: str = COMMIT_TIME) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message, when=when)
    return git(repo, "rev-parse", "HEAD")


def init_repo(repo: Path, when: str = COMMIT_TIME) -> Path:
    """Commit everything under ``repo`` (a fresh repository); build outputs are ignored."""
    (repo / ".gitignore").write_text(".kiln/\n.venv/\nout/\n")
    git(repo, "init", "-q", "-b", "main")
    commit_all(repo, "fixture", when)
    return repo


def git_project(name: str, dest: Path, when: str = COMMIT_TIME, edit=None) -> Path:
    """A fixture project committed in a fresh git repository; returns its kiln.toml."""
    repo = dest / name
    shutil.copytree(FIXTURES / name, repo, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    if edit is not None:
        edit(repo)
    init_repo(repo, when)
    return repo / "kiln.toml"


def vendor_acme_library(repo: Path) -> None:
    """Build the fixture's vendored library, as a team's checkout would carry it (*.so is not in Kiln's git)."""
    vendor = repo / "src" / "acme" / "vendor"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(vendor / "libacme_checksum.so"),
                    str(vendor / "checksum.c")], check=True, timeout=120)


def tiny_cpu_only(repo: Path) -> None:
    """Edit the tiny fixture's kiln.toml: its CPU variant only."""
    text = (repo / "kiln.toml").read_text()
    head, _, rest = text.partition("[[variants]]")
    cpu = '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n\n'
    (repo / "kiln.toml").write_text(head + cpu + rest[rest.index("[build]"):])


def tiny_cpu_with_numpy(repo: Path) -> None:
    """Edit the tiny fixture's kiln.toml: the CPU variant only, and numpy declared beside what tinyk imports."""
    text = (repo / "kiln.toml").read_text()
    declared = 'dependencies = ["kiln-runtime", "triton"]'
    assert declared in text, "the tiny fixture's dependencies changed: update this edit"
    text = text.replace(declared, 'dependencies = ["kiln-runtime", "triton", "numpy"]')
    head, _, rest = text.partition("[[variants]]")
    (repo / "kiln.toml").write_text(head + '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n\n'
                                    + rest[rest.index("[build]"):])
