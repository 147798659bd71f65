"""The matrix axes of a variant (issue 45, part 1): expansion into cells, bad input, interpreters, refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.tasks.build.interpreters import InterpreterMissingError, find_interpreter
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.project.config import load_config, parse_config
from tests.helpers.projects import copy_project

_BASE = {"project": {"package": "pkg", "distribution": "pkg", "version": "1.0", "source": "pkg"},
         "build": {"backend": "pep517"},
         "publish": {"default_target": "local", "targets": {"local": {"url": "file://{out}/index"}}}}


def _config(tmp_path: Path, **variant: object):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "setup.py").write_text("")
    return parse_config({**_BASE, "variants": [{"name": "cu130", "backend": "cuda", "archs": ["9.0"], **variant}]},
                        tmp_path)


def test_a_variant_without_axes_is_one_variant_as_before(tmp_path):
    (variant,) = _config(tmp_path).variants
    assert variant.name == variant.label == "cu130" and variant.cell is None


def test_the_axes_expand_into_cells_less_the_exclusions_each_with_its_name_label_and_torch(tmp_path):
    config = _config(tmp_path, python=["3.13", "3.12"], torch=["2.14.1", "2.13.0"],
                     build_requires=["torch==2.14.1", "ninja"], exclude=[{"python": "3.13", "torch": "2.13.0"}])
    cells = [(v.name, v.label, v.cell.python, v.cell.torch, v.build_requires) for v in config.variants]
    assert cells == [
        ("cu130py312torch2130", "cu130torch2.13", "3.12", "2.13.0", ("ninja", "torch==2.13.0")),
        ("cu130py312torch2141", "cu130torch2.14", "3.12", "2.14.1", ("ninja", "torch==2.14.1")),
        ("cu130py313torch2141", "cu130torch2.14", "3.13", "2.14.1", ("ninja", "torch==2.14.1")),
    ]
    assert {v.cell.matrix for v in config.variants} == {"cu130"}
    assert [v.name for v in config.cells_of("cu130")] == [c[0] for c in cells]
    with pytest.raises(ConfigError, match="is a matrix: name one of its cells"):
        config.variant("cu130")


def test_select_patterns_over_cell_names_keep_the_cells_they_name_and_one_naming_none_is_refused(tmp_path):
    config = _config(tmp_path, python=["3.12", "3.13"], torch=["2.13.0", "2.14.1"],
                     select=["*py313*", "cu130py312torch2141"])
    assert [v.name for v in config.variants] == ["cu130py312torch2141", "cu130py313torch2130", "cu130py313torch2141"]
    assert {v.select for v in config.variants} == {()}  # a cell is one cell: nothing left to select
    assert [v.name for v in _config(tmp_path, select=["cu130"]).variants] == ["cu130"]  # no axes: its own name
    with pytest.raises(ConfigError, match=r"variant 'cu130': select \['\*py311\*'\] matches no cell; its cells are"
                                          r" \['cu130py312', 'cu130py313'\]"):
        _config(tmp_path, python=["3.12", "3.13"], select=["*py311*", "*py312"])


def test_one_torch_keeps_the_plain_label_and_two_of_one_minor_spell_the_release(tmp_path):
    assert {v.label for v in _config(tmp_path, torch=["2.14.1"]).variants} == {"cu130"}
    assert [v.label for v in _config(tmp_path, torch=["2.14.0", "2.14.1"]).variants] == \
        ["cu130torch2.14.0", "cu130torch2.14.1"]


@pytest.mark.parametrize(("variant", "message"), [
    ({"python": ["3.x"]}, r"variants\[0\]\.python: '3.x' is not a CPython 'major.minor' version"),
    ({"python": ["3.12", "3.12"]}, r"variants\[0\]\.python: duplicate Pythons"),
    ({"python": ["2.7"]}, r"is not a CPython"),
    ({"torch": ["2.14.1+cu130"]}, r"variants\[0\]\.torch: '2.14.1\+cu130': give a torch release without a local"),
    ({"torch": ["two"]}, r"'two' is not a torch version"),
    ({"python": ["3.12"], "exclude": [{"python": "3.11"}]}, r"exclude\[0\]\.python = '3.11' matches no cell"),
    ({"python": ["3.12"], "exclude": [{"torch": "2.13.0"}]}, r"the variant has no torch axis"),
    ({"python": ["3.12"], "exclude": [{}]}, r"exclude\[0\]: an exclude entry names no axis"),
    ({"python": ["3.12"], "exclude": [{"python": "3.12"}]}, r"leaves no cell"),
    ({"python": ["3.12"], "exclude": [{"pyhton": "3.12"}]}, r"exclude\[0\]: an exclude entry names \['pyhton'\], not an axis"),
    ({"cell": {"matrix": "x", "label": "x"}}, r"variants\[0\]\.cell: Kiln sets it"),
])
def test_bad_axes_are_refused_naming_the_key(tmp_path, variant, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **variant)


def test_a_bad_interpreters_table_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"build\.interpreters: .*'three' is not a CPython"):
        parse_config({**_BASE, "build": {"backend": "pep517", "interpreters": {"three": "/x"}},
                      "variants": [{"name": "cpu", "backend": "cpu"}]}, tmp_path)


def _fake_python(path: Path, implementation: str, minor: str) -> Path:
    path.write_text(f"#!/bin/sh\necho 'KILN-PY [\"{implementation}\", \"{minor}\", \"{minor}.9\", \"{path}\"]'\n")
    path.chmod(0o755)
    return path


def test_the_interpreters_table_comes_first_and_an_interpreter_of_another_version_is_passed_over(tmp_path):
    mine = sys.version_info
    minor = f"{mine[0]}.{mine[1]}"
    wrong = _fake_python(tmp_path / "wrong", "cpython", "3.9")
    found, tried = find_interpreter(minor, {minor: str(wrong)}, tmp_path)
    assert found is not None and found.path != wrong and found.found_by != "kiln.toml [build.interpreters]"
    assert any(f"{wrong} is cpython 3.9.9, not CPython {minor}" in line for line in tried)
    right = _fake_python(tmp_path / "right", "cpython", minor)
    found, _ = find_interpreter(minor, {minor: "right"}, tmp_path)  # relative to kiln.toml
    assert found is not None and found.path == right and found.found_by == "kiln.toml [build.interpreters]"
    pypy = _fake_python(tmp_path / "pypy", "pypy", minor)
    assert find_interpreter(minor, {minor: str(pypy)}, tmp_path)[0].path != pypy  # type: ignore[union-attr]


def test_a_cell_without_an_interpreter_is_refused_before_anything_builds(tmp_path):
    config_path = copy_project("cmatrix", tmp_path)
    config_path.write_text(config_path.read_text().replace('python = ["3.10", "3.11", "3.12", "3.13"]',
                                                           'python = ["3.11", "3.99"]'))
    with pytest.raises(InterpreterMissingError) as refused:
        prepare_build(str(config_path), "1.0.0", None, cache_dir=str(tmp_path / "cache"))
    message = str(refused.value)
    assert "cell cpupy399 (Python 3.99): no CPython 3.99 found" in message and "cpupy311" not in message
    assert "[build.interpreters]" in message and "uv python install 3.99" in message
    assert not (tmp_path / "cache" / "envs").exists()  # nothing was made
    assert load_config(config_path).variant("cpupy399").cell.python == "3.99"  # type: ignore[union-attr]


def test_the_coverage_table_has_a_row_per_cell_and_a_cell_without_a_wheel_shows_what_it_asked_for(tmp_path):
    from kiln.core.manifest import RunManifest, Unit
    from kiln.tasks.run.coverage import coverage_rows

    config = _config(tmp_path, python=["3.12", "3.13"], torch=["2.13.0", "2.14.1"])
    run = RunManifest(tmp_path, "run-1")
    run.add_unit(Unit("build/cu130py313torch2130/wheel", "build", "failed", variant="cu130py313torch2130",
                      message="AbiAuditError: the wheel claims abi3"))
    rows = coverage_rows(config, run)
    assert [(r.variant, r.python, r.torch, r.state) for r in rows] == [
        ("cu130py312torch2130", "cp312", "==2.13.0", "not built"),
        ("cu130py312torch2141", "cp312", "==2.14.1", "not built"),
        ("cu130py313torch2130", "cp313", "==2.13.0", "not built"),
        ("cu130py313torch2141", "cp313", "==2.14.1", "not built"),
    ]
    assert rows[2].why == "AbiAuditError: the wheel claims abi3" and rows[0].why == "no build unit in this run"


def test_a_python_added_to_the_axis_leaves_the_other_cells_keys_as_they_were(tmp_path):
    from kiln.tasks.build.plan import backend_unit

    config_path = copy_project("cmatrix", tmp_path)
    before = {v.name: backend_unit(c, v, {}).key for c in [load_config(config_path)] for v in c.variants}
    config_path.write_text(config_path.read_text().replace('"3.12", "3.13"]', '"3.12"]'))
    after = {v.name: backend_unit(c, v, {}).key for c in [load_config(config_path)] for v in c.variants}
    assert after == {name: key for name, key in before.items() if name != "cpupy313"}
    assert len(set(before.values())) == 4  # every cell its own key


def test_a_torch_cell_whose_torch_cannot_be_had_is_refused_before_anything_builds(tmp_path):
    from kiln.tasks.build.interpreters import CellUnavailableError

    config_path = copy_project("cmatrix", tmp_path)
    config_path.write_text(config_path.read_text().replace('python = ["3.10", "3.11", "3.12", "3.13"]',
                                                           'python = ["3.11"]\ntorch = ["2.99.0"]'))
    with pytest.raises(CellUnavailableError) as refused:
        prepare_build(str(config_path), "1.0.0", None, cache_dir=str(tmp_path / "cache"))
    assert "cell cpupy311 (Python 3.11): torch==2.99.0 cannot be had here" in str(refused.value)
    assert not (tmp_path / "cache" / "envs").exists()  # nothing was made
