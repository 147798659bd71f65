"""kiln init finds the import package wherever the build config puts it: PEP 420 namespace packages
(``org/pkg/`` with no ``org/__init__.py``) through each form of ``packages.find``'s include patterns and
``package_dir``; where it finds none, its refusal says what it looked for, where, and what it found."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.onboarding import init_project
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import FIXTURES


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_namespace_package_found_through_packages_find_include_is_org_dot_pkg(tmp_path):
    repo = tmp_path / "nsops"
    shutil.copytree(FIXTURES / "nsops", repo, ignore=shutil.ignore_patterns("__pycache__", "kiln.toml"))
    result = init_project(repo)
    config = load_config(result.path)
    assert (config.project.package, config.project.source) == ("acmeorg.nsops", "src/acmeorg/nsops")
    assert config.project.distribution == "acmeorg-nsops" and result.findings.kind == "triton-jit"
    assert any("a PEP 420 namespace package: acmeorg/ has no __init__.py" in r for r in result.findings.reasons)


_SETUP_CFG = ("[metadata]\nname = fused-things\nversion = 0.2\n[options]\npackage_dir =\n    =python\n"
              "packages = find_namespace:\n[options.packages.find]\nwhere = python\ninclude = vendorx.*\n")
_SETUP_PY = ("from setuptools import setup, find_namespace_packages\nsetup(name='fused-things', version='0.2',"
             " packages=find_namespace_packages(where='python', include=['vendorx.*']),"
             " package_dir={'': 'python'})\n")
_PYPROJECT_LIST = ('[project]\nname = "fused-things"\nversion = "0.2"\n[tool.setuptools]\n'
                   'packages = ["vendorx.fused", "vendorx.fused.ops"]\npackage-dir = {"" = "python"}\n')


@pytest.mark.parametrize(("name", "config"), [("setup.cfg", _SETUP_CFG), ("setup.py", _SETUP_PY),
                                              ("pyproject.toml", _PYPROJECT_LIST)])
def test_each_form_of_the_build_config_names_a_namespace_package_kiln_init_takes(name, config, tmp_path):
    """The distribution is named otherwise than the package, and a regular package beside the namespace is
    not what the build ships: only the config's include pattern or list picks vendorx.fused."""
    stub = {"setup.py": "from setuptools import setup\nsetup()\n"} if name == "setup.cfg" else {}
    _write(tmp_path, {**stub, name: config, "python/vendorx/fused/__init__.py": "",
                      "python/vendorx/fused/ops/__init__.py": "", "python/aaa_helpers/__init__.py": ""})
    result = init_project(tmp_path)
    assert (result.findings.package, result.findings.source) == ("vendorx.fused", "python/vendorx/fused")
    assert load_config(result.path).project.package == "vendorx.fused"


def test_a_repository_with_no_package_is_refused_with_what_was_looked_for_where_and_what_was_found(
        tmp_path, capsys):
    _write(tmp_path, {"pyproject.toml": '[project]\nname = "x"\n[tool.setuptools.packages.find]\nwhere = ["lib"]\n'
                                        'include = ["x_ops*"]\n', "lib/x_ops.py": "", "README.md": ""})
    assert main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no Python package: kiln init looked for <name>/__init__.py (a package) and" in err
    assert "lib/ ([tool.setuptools.packages.find] where = 'lib')" in err and "src/ (src layout)" in err
    assert "its build config names ['x_ops*']" in err
    assert "the top level holds README.md, lib/, pyproject.toml" in err
    assert not (tmp_path / "kiln.toml").exists()
