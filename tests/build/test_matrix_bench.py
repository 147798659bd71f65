"""The bench stage on a Python matrix, as ``kiln init`` writes one: it measures the cell of Kiln's own Python
and says which cells it left; a package that declares no benchmarks is "not run", never a failure.

Before, the bench stage made its environment for the first cell's wheel (cp310) with Kiln's interpreter, uv
refused it ("no wheels with a matching Python version tag"), and a matrix package's nightly ended Failed.
The slow test is the whole path a new user takes: ``kiln init`` (no edits) and ``kiln nightly`` on the cmatrix
fixture (a CPython extension, requires-python >=3.10, no benchmarks, no torch).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.core.manifest import RunManifest
from kiln.tasks.bench.harness import bench_left, bench_skip, bench_variant, no_benchmarks
from kiln.tasks.project.config import parse_config
from kiln.tasks.run.coverage import coverage_rows
from tests.build.test_matrix_nightly import PYTHONS, needs_pythons
from tests.helpers.gitrepo import git_project

KILN = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _matrix(tmp_path: Path, pythons: tuple[str, ...], registry: bool = False) -> dict:
    (tmp_path / "cmx").mkdir(exist_ok=True)
    (tmp_path / "pyproject.toml").write_text("[build-system]\nrequires = [\"setuptools\"]\n")
    axis = ", ".join(f'"{p}"' for p in pythons)
    return tomllib.loads(f'[project]\npackage = "cmx"\ndistribution = "cmatrix"\nversion = "1.0"\nsource = "cmx"\n'
                         f'{"registry = " + chr(34) + "cmx.reg:registry" + chr(34) if registry else ""}\n'
                         f'[[variants]]\nname = "cpu"\nbackend = "cpu"\npython = [{axis}]\n'
                         '[build]\nbackend = "pep517"\n[publish.targets.local]\nurl = "file://{out}/i"\n'
                         '[publish]\ndefault_target = "local"\n')


def _cell(python: str) -> str:
    return f"cpupy3{python.split('.')[1]}"


def test_the_matrix_bench_measures_the_cell_of_kilns_python_and_names_the_others(tmp_path):
    pythons = tuple(sorted({"3.10", KILN, "3.13"}, key=lambda p: int(p.split(".")[1])))
    config = parse_config(_matrix(tmp_path, pythons, registry=True), tmp_path)
    assert bench_skip(config) == "" and no_benchmarks(config) == ""
    assert bench_variant(config) == _cell(KILN)
    left = {u.id: u for u in bench_left(config, _cell(KILN))}
    assert sorted(left) == sorted(f"bench/{_cell(p)}" for p in pythons if p != KILN)
    for python in pythons:
        if python != KILN:
            unit = left[f"bench/{_cell(python)}"]
            assert unit.state == "not_run" and unit.variant == _cell(python)
            assert f"for Python {python}" in unit.message and f"measured {_cell(KILN)}" in unit.message


def test_a_matrix_without_kilns_python_is_not_run_naming_its_cells(tmp_path):
    others = tuple(p for p in ("3.12", "3.13", "3.10") if p != KILN)[:2]
    config = parse_config(_matrix(tmp_path, others, registry=True), tmp_path)
    why = bench_skip(config)
    assert why.startswith(f"not run: the harness measures in an environment of Kiln's interpreter (Python {KILN})")
    assert all(f"{_cell(p)} (Python {p})" in why for p in others)


def test_a_package_without_benchmarks_is_not_run(tmp_path):
    config = parse_config(_matrix(tmp_path, (KILN,)), tmp_path)
    assert no_benchmarks(config).startswith("not run: the package declares no benchmarks")


def _init_only(repo: Path) -> None:
    from kiln.tasks.onboarding import init_project

    (repo / "kiln.toml").unlink()
    init_project(repo)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kiln_init_and_a_nightly_alone_complete_on_a_python_matrix(prefect_server, tmp_path):
    from kiln.flows.nightly import nightly_flow

    needs_pythons()
    config_path = git_project("cmatrix", tmp_path, edit=_init_only)
    assert 'python = ["3.10", "3.11", "3.12", "3.13"]' in config_path.read_text()  # init wrote the axis
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config_path), out=str(out), return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert state.is_completed(), {u.id: (u.state, u.message) for u in run.units if u.state == "failed"}
    bench = [u for u in run.units if u.stage == "bench"]
    assert bench and all(u.state == "not_run" for u in bench), bench
    assert any("declares no benchmarks" in u.message for u in bench)
    wheels = {a.variant: Path(a.path).name for a in run.artifacts_of("wheel")}
    assert set(wheels) == {_cell(p) for p in PYTHONS}
    for python in PYTHONS:  # every cell's wheel manylinux, and its suite passed under its own Python
        (tag,) = parse_wheel_filename(wheels[_cell(python)])[3]
        assert tag.platform.startswith("manylinux_") and tag.interpreter == f"cp3{python.split('.')[1]}", wheels
        assert units[f"test/unit/{_cell(python)}"].state == "completed"
    rows = coverage_rows(parse_config(tomllib.loads(config_path.read_text()), config_path.parent), run)
    assert [r.state for r in rows] == ["tested"] * len(PYTHONS)
