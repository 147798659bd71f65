"""Where kiln init cannot decide (several import packages fit, or the package declares two names), the kiln.toml
it writes holds the candidates as a commented choice and the command says so on stderr: never a silent guess."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kiln.flows.cli import main
from kiln.tasks.onboarding import init_project
from kiln.tasks.project.config import load_config


def _project(root: Path, packages: tuple[str, ...], pyproject: str, setup_cfg: str = "") -> Path:
    for package in packages:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(pyproject)
    if setup_cfg:
        (root / "setup.cfg").write_text(setup_cfg)
    return root


_PYPROJECT = '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n' \
             '[project]\nname = "{name}"\nversion = "1.0.0"\n'


def test_several_import_packages_none_named_like_the_distribution_are_a_commented_choice(tmp_path, capsys):
    repo = _project(tmp_path / "repo", ("beta", "alpha", "gamma"), _PYPROJECT.format(name="ops"))
    assert main(["init", str(repo)]) == 0
    text = (repo / "kiln.toml").read_text()
    assert 'package = "alpha"  # kiln init could not decide: also "beta", "gamma" - pick one (and source, its' \
           ' folder)' in text.splitlines()
    assert "could not decide between ['alpha', 'beta', 'gamma']" in text  # the header says why
    project = load_config(repo / "kiln.toml").project  # still a file Kiln loads as it is
    assert (project.package, project.source) == ("alpha", "alpha")
    err = capsys.readouterr().err
    assert "kiln init: could not decide the package: wrote 'alpha', also 'beta', 'gamma'; pick one in" in err


def test_two_names_the_package_declares_are_a_commented_choice_and_one_name_is_no_question(tmp_path, capsys):
    repo = _project(tmp_path / "two", ("fastops",), _PYPROJECT.format(name="fast-ops"),
                    "[metadata]\nname = fastops-cuda\n")
    assert main(["init", str(repo)]) == 0
    text = (repo / "kiln.toml").read_text()
    assert 'distribution = "fast-ops"  # kiln init could not decide: also "fastops-cuda" - pick one' \
           in text.splitlines()
    assert ("'fast-ops' in pyproject.toml [project] name; 'fastops-cuda' in setup.cfg [metadata] name") in text
    assert "could not decide the distribution: wrote 'fast-ops', also 'fastops-cuda'" in capsys.readouterr().err
    # the same name spelled two ways, and a package named like the distribution among several: decided
    plain = _project(tmp_path / "one", ("fast_ops", "tools"), _PYPROJECT.format(name="fast-ops"),
                     "[metadata]\nname = Fast_Ops\n")
    result = init_project(plain)
    assert result.findings.undecided == () and "could not decide" not in result.text
    assert tomllib.loads(result.text)["project"]["package"] == "fast_ops"
