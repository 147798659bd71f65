"""The Python matrix through a real nightly (issue 45, parts 1, 3 and 5): a CPython C-API extension (no torch)
built by this machine's CPython 3.10-3.13, each cell's wheel tested in an environment of its own Python, and all
four published to the one index of their variant (``nightly/cpu/simple``), from which pip and uv under 3.12 take
the cp312 wheel."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import parse_wheel_filename

from kiln.core.manifest import RunManifest
from kiln.tasks.build.interpreters import find_interpreter
from kiln.tasks.project.config import load_config
from kiln.tasks.run.coverage import coverage_rows
from tests.helpers.gitrepo import git_project

PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def needs_pythons() -> None:
    missing = [p for p in PYTHONS if find_interpreter(p, {}, Path("."))[0] is None]
    if missing:
        pytest.skip(f"no CPython {missing} on this machine")

# One cell fails its suite (3.12), one has nothing it can run (3.13: every test skipped).
_ODD_CELLS = '''
import sys

import pytest


@pytest.mark.skipif(sys.version_info[:2] == (3, 13), reason="nothing to check on 3.13")
def test_not_three_twelve():
    assert sys.version_info[:2] != (3, 12), "this cell is meant to fail"
'''


def _odd_cells(project: Path) -> None:
    (project / "odd").mkdir()
    (project / "odd" / "test_odd.py").write_text(_ODD_CELLS)
    toml = project / "kiln.toml"
    # not required: its failure fails the run, yet holds no cell back from the index
    toml.write_text(toml.read_text().replace('[publish]\n', '[[suites]]\nname = "odd"\npaths = ["odd"]\n'
                                          'variants = ["cpupy312", "cpupy313"]\nrequired = false\n\n[publish]\n'))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_nightly_builds_and_tests_one_wheel_per_python_and_accounts_for_every_cell(prefect_server, tmp_path):
    from kiln.flows.nightly import nightly_flow

    needs_pythons()
    config_path = git_project("cmatrix", tmp_path, edit=_odd_cells)
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config_path), out=str(out), return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    wheels = {a.variant: Path(a.path).name for a in run.artifacts_of("wheel")}
    assert set(wheels) == {f"cpupy3{p.split('.')[1]}" for p in PYTHONS}, wheels
    assert len(set(wheels.values())) == 4  # no two cells' wheels share a name
    for python in PYTHONS:
        cell = f"cpupy3{python.split('.')[1]}"
        name, version, _, tags = parse_wheel_filename(wheels[cell])
        assert str(version).endswith("+cpu") and {t.interpreter for t in tags} == {f"cp3{python.split('.')[1]}"}
        # the suite imported the wheel's extension in an environment of the cell's own Python (built_for says so)
        assert units[f"test/unit/{cell}"].state == "completed", units[f"test/unit/{cell}"].message
        assert units[f"test/unit/{cell}"].message.startswith("2 passed")
    assert units["test/odd/cpupy312"].state == "failed"
    assert units["test/odd/cpupy313"].state == "not_run"
    rows = {r.variant: r for r in coverage_rows(load_config(config_path), run)}
    assert [r.python for r in rows.values()] == ["cp310", "cp311", "cp312", "cp313"]
    assert rows["cpupy310"].state == rows["cpupy311"].state == "tested"
    assert rows["cpupy312"].state == "failed" and "odd" in rows["cpupy312"].why
    assert rows["cpupy313"].state == "tested" and "odd not run" in rows["cpupy313"].why
    assert not state.is_completed()  # the failed cell fails the run (invariant 4)
    _one_index_for_the_matrix(run, out / "index" / "nightly", tmp_path)


def _one_index_for_the_matrix(run: RunManifest, channel: Path, tmp_path: Path) -> None:
    """Every cell's wheel in the variant's one index (and its per-commit index); one install hint for it, which
    pip and uv under Python 3.12 follow to the cp312 wheel."""
    assert sorted(p.name for p in channel.iterdir()) == ["cpu"]  # no index per cell
    index = channel / "cpu" / "simple"
    page = json.loads((index / "cmatrix" / "index.json").read_text())
    tags = sorted(parse_wheel_filename(f["filename"])[3] for f in page["files"])
    assert [next(iter(t)).interpreter for t in tags] == ["cp310", "cp311", "cp312", "cp313"], page["files"]
    commits = list((channel / "cpu" / "commits").glob("*/simple/cmatrix/index.json"))
    assert len(commits) == 1 and len(json.loads(commits[0].read_text())["files"]) == 4
    info: dict[str, Any] = dict(run.info)
    urls = info["index_url"]
    assert len(urls) == 1 and urls[0].endswith("/nightly/cpu/simple/"), urls  # the hint is printed once
    facts = info["install"]["indexes"][urls[0]]
    assert facts["pythons"] == ["cp310", "cp311", "cp312", "cp313"]
    python = str(find_interpreter("3.12", {}, Path("."))[0].path)  # type: ignore[union-attr]
    requirement, url = facts["requirement"], index.as_uri() + "/"
    for tool, install in (("pip", [python, "-m", "pip", "install", "--isolated", "--disable-pip-version-check",
                                   "--no-cache-dir", "--only-binary", ":all:"]),
                          ("uv", ["uv", "pip", "install", "--no-cache", "--python", python])):
        target = tmp_path / f"{tool}-target"
        subprocess.run([*install, "--quiet", "--no-deps", "--index-url", url, "--target", str(target), requirement],
                       check=True, timeout=300)
        [record] = target.glob("cmatrix-*.dist-info/WHEEL")
        assert "Tag: cp312-cp312-" in record.read_text(), (tool, record.read_text())
        probe = subprocess.run([python, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); import cmx;"
                                " print(cmx.__file__)"], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, (tool, probe.stderr)
