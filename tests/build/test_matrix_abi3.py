"""abi3 in a matrix (issue 45, part 1): a py_limited_api extension is one cp310-abi3 wheel that every Python
from 3.10 installs and imports; a second cell of the axis would write another wheel of the same name, so it
keeps none and says which cell carries it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.tasks.build.interpreters import find_interpreter
from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
from kiln.tasks.build.units import build_unit
from kiln.tasks.project.config import load_config
from kiln.tasks.project.config_matrix import abi3_served
from tests.helpers.projects import copy_project

PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def _abi3(config_path: Path, pythons: str) -> Path:
    text = config_path.read_text().replace('python = ["3.10", "3.11", "3.12", "3.13"]',
                                           f"python = {pythons}\nbuild_env = {{CMX_ABI3 = \"1\"}}")
    config_path.write_text(text)
    return config_path


def test_a_second_cell_of_an_abi3_build_keeps_no_wheel_and_names_the_cell_that_carries_it(tmp_path):
    config = load_config(_abi3(copy_project("cmatrix", tmp_path), '["3.10", "3.12"]'))
    wheel = "cmatrix-1.0.0-cp310-abi3-linux_x86_64.whl"
    assert abi3_served(config.variants, "cpupy310", wheel) == ""
    why = abi3_served(config.variants, "cpupy312", wheel)
    assert "cell cpupy310 (Python 3.10) carries it" in why and 'python = ["3.10"]' in why
    assert abi3_served(config.variants, "cpupy312", "cmatrix-1.0.0-cp312-cp312-linux_x86_64.whl") == ""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_abi3_fixture_is_one_cp310_abi3_wheel_that_installs_and_imports_under_every_python(tmp_path):
    found = {p: find_interpreter(p, {}, Path("."))[0] for p in PYTHONS}
    if None in found.values():
        pytest.skip(f"no CPython {[p for p, i in found.items() if i is None]} on this machine")
    setup = prepare_build(str(_abi3(copy_project("cmatrix", tmp_path), '["3.10"]')), "1.0.0.dev1", None,
                          cache_dir=str(tmp_path / "cache"))
    (variant,) = setup.plan.variants
    with compile_context(setup, tmp_path / "out") as context:
        outcomes = {u.id: build_unit(u, context) for u in variant.units}
    output = assemble_variant(setup, variant, outcomes, tmp_path / "out")  # type: ignore[arg-type]
    assert output.unit.state == "completed", output.unit.message
    (wheel,) = [path for path, kind in output.files if kind == "wheel"]
    assert {(t.interpreter, t.abi) for t in parse_wheel_filename(wheel.name)[3]} == {("cp310", "abi3")}
    for python, interpreter in found.items():
        venv = tmp_path / f"venv{python}"
        subprocess.run(["uv", "venv", "--quiet", "--python", str(interpreter.path), str(venv)],  # type: ignore[union-attr]
                       check=True, timeout=120, env=os.environ | {"UV_PYTHON_DOWNLOADS": "never"})
        subprocess.run(["uv", "pip", "install", "--quiet", "--no-deps", "--python", str(venv / "bin" / "python"),
                        str(wheel)], check=True, timeout=300, capture_output=True)
        probe = subprocess.run([str(venv / "bin" / "python"), "-I", "-c",
                                "import sys, cmx; print(cmx.add(2, 3), cmx.built_for(), sys.version_info[1])"],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert probe.stdout.split() == ["5", "abi3", python.split(".")[1]], probe.stderr
