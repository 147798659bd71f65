"""kiln init's Python axis (issue 45): requires-python ∩ the CPythons found here, each one left out named."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kiln.tasks.build.interpreters import Interpreter
from kiln.tasks.onboarding.pythons import python_axis, with_python_axis

HERE = ("3.10", "3.11", "3.12")  # what the fake machine has


def _find(minor: str) -> Interpreter | None:
    return Interpreter(minor, Path(f"/opt/python{minor}"), f"{minor}.1", "PATH") if minor in HERE else None


def _project(tmp_path: Path, setup_py: str) -> Path:
    (tmp_path / "setup.py").write_text(setup_py)
    return tmp_path


TOML = ('[project]\npackage = "p"\n\n[[variants]]\nname = "cpu"\nbackend = "cpu"\n\n[build]\nbackend = "pep517"\n')


def test_the_axis_is_requires_python_and_what_is_found_and_every_python_left_out_says_why():
    axis, left = python_axis(">=3.11", _find)
    assert axis == ("3.11", "3.12")
    assert left[0] == "3.10: requires-python '>=3.11' excludes it"
    assert left[1].startswith("3.13: no CPython 3.13 found here (uv python install 3.13")
    assert len(left) == 3 and left[2].startswith("3.14:")
    assert python_axis(">=3.10,<3.12", _find)[0] == ("3.10", "3.11")


def test_a_c_extension_gets_the_axis_on_each_variant_and_a_pure_package_none(tmp_path):
    (tmp_path / "n").mkdir()
    native = _project(tmp_path / "n", "from setuptools import Extension, setup\n"
                                      "setup(ext_modules=[Extension('x', ['x.c'])])\n")
    text = with_python_axis(TOML, "pep517", False, ">=3.11", native, _find)
    variant = tomllib.loads(text)["variants"][0]
    assert variant["python"] == ["3.11", "3.12"]
    assert "# left out of the python axis: 3.10: requires-python '>=3.11' excludes it" in text
    torch = with_python_axis(TOML, "pep517", True, ">=3.11", native, _find)
    assert "python" not in tomllib.loads(torch)["variants"][0] and '# python = ["3.11", "3.12"]' in torch
    (tmp_path / "pure").mkdir()
    pure = _project(tmp_path / "pure", "from setuptools import setup\nsetup()\n")
    assert with_python_axis(TOML, "pep517", False, ">=3.11", pure, _find) == TOML
    assert with_python_axis(TOML, "registry", False, ">=3.11", native, _find) == TOML
