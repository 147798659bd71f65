"""``kiln bisect --test``: the first bad commit from the wheels the runs stored; a commit no run built is
built once, kept, and reused by the next bisect."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.run.bisect import commit_range, first_bad
from tests.helpers.gitrepo import commit_all, git, git_project

TEST = "tests/test_tiny.py::test_tiny_imports"  # asserts tinyk.__version__ == "0.1.0"


def _build(config: Path, out: Path) -> None:
    from kiln.flows.build import build_flow
    from kiln.flows.run.common import sync_state

    state = sync_state(build_flow(config_path=str(config), out=str(out), variants=["cpu"], return_state=True))
    assert state.is_completed(), state.message


def _bisect(config: Path, good: str, bad: str) -> str:
    from kiln.flows.bisect import bisect_flow
    from kiln.flows.run.common import sync_state

    state = sync_state(bisect_flow(good=good, bad=bad, test=TEST, config_path=str(config), return_state=True))
    assert state.is_completed(), state.message
    return str(state.result())


def _three_commits(tmp_path: Path) -> tuple[Path, list[str]]:
    """good (built by a run), the commit that breaks the test (never built), a later one (built by a run)."""
    config = git_project("tiny", tmp_path)
    repo = config.parent
    good = git(repo, "rev-parse", "HEAD")
    _build(config, tmp_path / "out")
    init = repo / "tinyk" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.1.1"'))
    breaking = commit_all(repo, "bump the version string", when="2025-12-01T00:00:00Z")
    (repo / "NOTES.md").write_text("unrelated\n")
    later = commit_all(repo, "notes", when="2025-12-02T00:00:00Z")
    _build(config, tmp_path / "out")
    return config, [good, breaking, later]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bisect_names_the_breaking_commit_building_only_the_one_no_run_stored(prefect_server, tmp_path):
    config, (good, breaking, later) = _three_commits(tmp_path)
    report = _bisect(config, good, later)
    assert report.startswith(f"first bad commit: {breaking} ({breaking[:7]} bump the version string)"), report
    tried = {line.split()[0]: line for line in report.splitlines() if re.match(r"  [0-9a-f]{12}  ", line)}
    assert set(tried) == {good[:12], breaking[:12], later[:12]}  # log2 of two candidates, and the two ends
    assert "wheel: run " in tried[good[:12]] and "wheel: run " in tried[later[:12]]  # installed, not rebuilt
    assert "built now (no run stored its wheels)" in tried[breaking[:12]]
    assert "AssertionError" in report and "0.1.1" in report  # the failing test's own message, from that commit
    again = _bisect(config, good, later)  # the wheel built for the middle commit was kept: not built again
    assert "built earlier by bisect" in next(line for line in again.splitlines() if line.startswith(f"  {breaking[:12]}"))


def test_refs_that_do_not_bisect_are_refused(tmp_path):
    config = git_project("tiny", tmp_path)
    repo = config.parent
    first = git(repo, "rev-parse", "HEAD")
    second = commit_all(repo, "next")
    assert commit_range(repo, first, second) == (first, [second])
    with pytest.raises(InvalidInputError, match="does not descend"):
        commit_range(repo, second, first)
    with pytest.raises(InvalidInputError, match="same commit"):
        commit_range(repo, "HEAD", second)
    with pytest.raises(InvalidInputError, match="no-such-ref"):
        commit_range(repo, "no-such-ref", second)
    git(repo, "checkout", "-q", "-b", "side", first)
    side = commit_all(repo, "on a side branch")
    git(repo, "checkout", "-q", "main")
    git(repo, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    merge = git(repo, "rev-parse", "HEAD")
    with pytest.raises(InvalidInputError, match="not on the first-parent history"):
        commit_range(repo, side, merge)  # the search walks first parents: second would be tried without side
    assert commit_range(repo, second, merge) == (second, [merge])


def test_the_search_asks_log2_n_commits():
    commits = [f"c{i}" for i in range(16)]
    asked: list[str] = []

    def is_bad(commit: str) -> bool:
        asked.append(commit)
        return int(commit[1:]) >= 11

    assert first_bad(commits, is_bad) == "c11" and len(asked) == 4


BENCHPROJ = Path(__file__).resolve().parents[1] / "bench" / "fixtures" / "benchproj"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bisect_bench_names_the_commit_that_made_a_kernel_slower(prefect_server, tmp_path):
    """benchproj: the middle commit makes axpy 30 times the work; bisect measures each commit's stored (or,
    for the middle one, built) wheel and names it, with both medians as the evidence."""
    import shutil

    from tests.helpers.gitrepo import init_repo

    repo = tmp_path / "benchproj"
    shutil.copytree(BENCHPROJ, repo, ignore=shutil.ignore_patterns("__pycache__"))
    init_repo(repo)
    config = repo / "kiln.toml"
    good = git(repo, "rev-parse", "HEAD")
    _build(config, tmp_path / "out")
    registry = repo / "benchk" / "registry.py"
    registry.write_text(registry.read_text().replace(
        "    return torch.add(y, x, alpha=2.0)\n",
        "    for _ in range(30):\n        out = torch.add(y, x, alpha=2.0)\n    return out\n"))
    slower = commit_all(repo, "axpy does its work thirty times", when="2025-12-01T00:00:00Z")
    (repo / "NOTES.md").write_text("unrelated\n")
    later = commit_all(repo, "notes", when="2025-12-02T00:00:00Z")
    _build(config, tmp_path / "out")
    from kiln.flows.bisect import bisect_flow
    from kiln.flows.run.common import sync_state

    state = sync_state(bisect_flow(good=good, bad=later, bench="axpy/n4096", config_path=str(config),
                                   return_state=True))
    assert state.is_completed(), state.message
    report = str(state.result())
    assert report.startswith(f"first bad commit: {slower}"), report
    assert "axpy/n4096 [cpu] kernel/reference" in report and "noise ±" in report  # both medians, the noise
