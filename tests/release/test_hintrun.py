"""``kiln verify --hint``: only the hints Kiln prints are run; anything else is refused before anything runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.flows.cli import main
from kiln.flows.report.hint import UV_VARIANTS
from kiln.release.cli import EXIT_USAGE
from kiln.release.install.hintrun import parse_hint
from kiln.release.install.installer import UV_UNSET, index_options, pip_steps, printed_pip, printed_uv


def test_a_printed_hint_parses_into_its_options_and_one_requirement():
    hint = parse_hint("pip install --index-url file:///x/simple/ --extra-index-url https://pypi.org/simple "
                      "Demo_Kernels==0.8.2.dev5+cpu")
    assert hint.options == ("--index-url", "file:///x/simple/", "--extra-index-url", "https://pypi.org/simple")
    assert (hint.project, str(hint.requirement.specifier)) == ("demo-kernels", "==0.8.2.dev5+cpu")
    assert parse_hint("pip install -i=file:///x/ demo").options == ("-i", "file:///x/")


def test_a_two_step_hint_parses_into_its_steps_and_is_for_its_first_requirement():
    hint = parse_hint("pip install --index-url file:///k/ --no-deps demo==1.0+cpu 'rt==0.1; python_version > \"3\"' "
                      "&& pip install --index-url file:///k/ --extra-index-url https://pypi.org/simple demo==1.0+cpu")
    assert [step.options for step in hint.steps] == [
        ("--index-url", "file:///k/", "--no-deps"),
        ("--index-url", "file:///k/", "--extra-index-url", "https://pypi.org/simple")]
    assert [str(r) for r in hint.steps[0].requirements] == ["demo==1.0+cpu", 'rt==0.1; python_version > "3"']
    assert (hint.project, hint.steps[1].index_url, hint.steps[1].indexes) == (
        "demo", "file:///k/", ["file:///k/", "https://pypi.org/simple"])


def test_the_printed_isolated_form_parses_with_the_variables_it_sets_itself():
    printed = install_command_for("file:///k/")
    hint = parse_hint(printed)
    assert [step.env for step in hint.steps] == [(("PIP_CONFIG_FILE", os.devnull),)] * 2, printed
    assert all("--isolated" in step.options for step in hint.steps)
    assert parse_hint("PIP_CONFIG_FILE=/dev/null pip install --isolated demo").steps[0].env == (
        ("PIP_CONFIG_FILE", "/dev/null"),)


def test_the_printed_uv_hint_parses_with_the_kiln_index_first_and_the_names_it_unsets():
    printed = printed_uv([*UV_VARIANTS, *index_options("uv", "file:///k/", ["https://pypi.org/simple"]),
                          "demo==1.0"])
    step = parse_hint(printed).steps[0]
    assert (step.tool, step.unset, step.index_url) == ("uv", UV_UNSET, "file:///k/")
    assert step.indexes == ["file:///k/", "https://pypi.org/simple"]
    assert [str(r) for r in step.requirements] == ["demo==1.0"] and "--no-config" in step.options


def install_command_for(url: str) -> str:
    return printed_pip(pip_steps(url, "demo==1.0+cpu", ["rt==0.1"], ["https://pypi.org/simple"]))


@pytest.mark.parametrize(("hint", "why"), [
    ("env AWS_PROFILE=x pip install demo", "sets 'AWS_PROFILE'; a hint Kiln prints sets only PIP_* variables"),
    ("env -u PIP_X pip install demo", "each command must start with 'pip install'"),
    ("uv pip install demo", "a uv hint Kiln prints has --no-config"),
    ("env -u HOME uv pip install --no-config demo", "unsets 'HOME'; a uv hint Kiln prints unsets only UV_*"),
    ("uv pip install --no-config --index-strategy unsafe-best-match demo", "Kiln prints only 'first-index'"),
    ("uv pip install --no-config --find-links /tmp demo", "uv option '--find-links' is not one Kiln prints"),
    ("uv pip install --no-config --index ftp://host/simple demo", "pip and uv read http://, https:// or file:///"),
    ("uv pip install --no-config", "names 0 requirements"),
    ("pip install --target /tmp/x demo", "option '--target' is not one Kiln prints"),
    ("pip install --index-url file:///x/ demo other", "names 2 requirements, not exactly one"),
    ("pip install --index-url ftp://host/simple demo", "pip and uv read http://, https:// or file:///"),
    ("pip install 'demo==", "No closing quotation"),
    ("pip install demo>=>1", "Expected"),
    ("pip install --no-deps a==1 b==2 && rm -rf /", "each command must start with 'pip install'"),
    ("pip install --no-deps a==1 rt==2 && pip install b==1", "its steps install different projects first"),
    ("pip install a==1 && pip install", "names 0 requirements"),
])
def test_a_hint_kiln_does_not_print_is_refused_naming_it(hint, why):
    with pytest.raises(InvalidInputError, match="^install hint ") as caught:
        parse_hint(hint)
    assert why in str(caught.value)


def test_kiln_verify_refuses_a_bad_hint_before_reading_the_index(tmp_path: Path, capsys):
    missing = (tmp_path / "no-index").as_uri() + "/"  # never read: the hint is refused first
    assert main(["verify", missing, "--hint", "pip install --user demo"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "install hint 'pip install --user demo': option '--user' is not one Kiln prints" in err
    assert not (tmp_path / "no-index").exists()
