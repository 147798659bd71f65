"""The generated reference pages are current: docs/reference/ holds exactly what the parser and the models render."""

from __future__ import annotations

import argparse

from kiln.flows.cli import build_parser
from kiln.flows.report import reference
from kiln.tasks.project import config_reference
from kiln.tasks.project.config import KilnConfig


def test_the_committed_reference_pages_are_what_the_code_renders_now():
    stale = reference.stale()
    assert stale == [], f"stale reference pages {stale}: regenerate them with `{reference.REGENERATE}` and commit"


def test_the_check_names_a_stale_page_and_the_command_that_regenerates_it(tmp_path, capsys):
    assert reference.main(["--docs", str(tmp_path)]) == 0
    assert reference.main(["--docs", str(tmp_path), "--check"]) == 0
    page = tmp_path / "reference" / "kiln-toml.md"
    page.write_text(page.read_text() + "a hand edit\n")
    assert reference.main(["--docs", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert str(page) in err and reference.REGENERATE in err
    assert reference.main(["--docs", str(tmp_path)]) == 0 and reference.stale(tmp_path) == []


def _all_subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_all_subcommands(sub)]
    return found


def test_the_cli_reference_names_every_subcommand_and_every_flag():
    page = reference.render_cli()
    subs = _all_subcommands(build_parser())
    assert len(subs) >= 18
    for sub in subs:
        assert f"`{sub.prog}`" in page, sub.prog
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page or f", {flag}" in page, f"{sub.prog} {flag}"


def test_the_config_reference_has_every_table_and_every_key_with_its_default():
    page = config_reference.render()
    tables = list(config_reference.tables())
    headers = [t.header for t in tables]
    for header in ("[project]", "[[variants]]", "[build.toolchain]", "[[suites]]",
                   "[testing.quarantine]", "[bench.regression]", "[publish.retention]",
                   '[publish.targets.<name>] with kind = "upload"', "[permissions.<step>.credentials]"):
        assert header in headers and f"## `{header}`" in page
    for table in tables:
        section = page.split(f"## `{table.header}`\n", 1)[1].split("\n## ", 1)[0]
        for name, info in table.model.model_fields.items():
            if info.exclude or (table.path, name) == ("variants", "cell"):
                continue
            assert f"| `{name}` |" in section, f"{table.header} {name}"
    assert "| `jobs` | integer | `2` | ≥ 1, ≤ 256 |" in page
    assert "`exact`, `stable`" in page  # a Literal's allowed values
    assert "- `timeout_s`: use `test_timeout_s`" in page  # a deprecated spelling the loader still takes
    assert "`cell`" not in page  # Kiln sets it on each matrix cell; no kiln.toml may
    assert "`root`" not in page and "`config_file`" not in page
    assert KilnConfig.model_fields["project"].is_required()


def test_a_key_added_to_a_model_appears_with_its_comment():
    from pydantic import BaseModel, Field

    class Widget(BaseModel):
        """[widget]: a table for this test."""

        # How many widgets, at most.
        count: int = Field(default=3, ge=1)
        colour: str = "blue"  # the widget's colour

    lines = config_reference.render_table(config_reference.Table("[widget]", Widget, "widget"))
    text = "\n".join(lines)
    assert "| `count` | integer | `3` | ≥ 1 | How many widgets, at most. |" in text
    assert "| `colour` | string | `\"blue\"` | — | the widget's colour |" in text
