"""The end-of-run summary says what a release engineer must read first."""

from __future__ import annotations

from pathlib import Path

from kiln.flows.summary import render_markdown, render_text
from kiln.release.manifest import RunManifest, Unit


def make_run(tmp_path: Path) -> RunManifest:
    run = RunManifest(tmp_path, "r1", flow="nightly", version="0.1.0.dev1")
    run.add_unit(Unit("build/cu130/9.0/quant/a", "build", "completed", variant="cu130"))
    run.add_unit(Unit("build/cu130/8.0/quant/b", "build", "failed", variant="cu130", message="ptxas error\ndetails"))
    run.add_unit(Unit("build/rocm/gfx90a/quant/fp8", "build", "skipped", message="needs gfx942"))
    run.add_unit(Unit("test/kernels", "test", "flaky", message="1 flaky"))
    return run


def test_text_summary_counts_stages_and_lists_failures_before_skips(tmp_path):
    text = render_text(make_run(tmp_path))
    assert "build     3 units: 1 failed, 1 skipped, 1 completed" in text
    failed, flaky, skipped = (text.index(s) for s in ("FAILED    build/cu130/8.0", "FLAKY", "SKIPPED"))
    assert failed < flaky < skipped
    assert "ptxas error" in text and "details" not in text  # first line only


def test_text_summary_prints_the_publish_plan_and_the_index(tmp_path):
    run = make_run(tmp_path)
    run.info["publish_plan"] = "## Publish (dry run)\n- added: 1"
    run.info["index_url"] = ["file:///x/nightly/cpu/simple/"]
    text = render_text(run)
    assert "  ## Publish (dry run)" in text and "  - added: 1" in text
    assert "index: file:///x/nightly/cpu/simple/" in text


def test_the_index_line_comes_with_the_full_install_command_and_why_it_needs_an_extra_index(tmp_path):
    from kiln.tasks.config import load_config
    from kiln.tasks.releasing import install_info

    run = make_run(tmp_path)
    run.info["index_url"] = ["file:///x/nightly/cpu/simple/"]
    run.info["install"] = install_info(load_config(Path(__file__).resolve().parents[2] / "kiln.toml"))
    text = render_text(run)
    assert ("install: pip install --index-url file:///x/nightly/cpu/simple/ "
            "--extra-index-url https://pypi.org/simple kiln-kernels") in text
    assert "its dependencies torch, triton, numpy, kiln-runtime are not on it and resolve from https://pypi.org/simple" in text
    assert "--extra-index-url https://pypi.org/simple kiln-kernels`" in render_markdown(run)


def test_without_an_extra_index_the_hint_says_the_dependencies_must_be_there(tmp_path):
    run = make_run(tmp_path)
    run.info["index_url"] = ["http://h/simple/"]
    run.info["install"] = {"distribution": "demo", "dependencies": ["torch>=2.6"], "extra_index_urls": []}
    text = render_text(run)
    assert "install: pip install --index-url http://h/simple/ demo" in text
    assert "its dependencies torch must already be installed" in text


def test_markdown_summary_has_a_row_per_stage_and_escapes_pipes(tmp_path):
    run = make_run(tmp_path)
    run.add_unit(Unit("test/x", "test", "failed", message="a | b"))
    markdown = render_markdown(run)
    assert "| build | 3 | 1 failed, 1 skipped, 1 completed |" in markdown
    assert "a \\| b" in markdown


def test_the_display_orders_cover_every_state_and_stage():
    from typing import get_args

    from kiln.flows.summary import STAGE_ORDER, STATE_ORDER
    from kiln.release.manifest import Stage, UnitState

    assert sorted(STATE_ORDER) == sorted(get_args(UnitState))
    assert STAGE_ORDER == get_args(Stage)


def test_a_variant_published_untested_is_named_in_the_first_lines(tmp_path):
    run = make_run(tmp_path)
    run.info["published_untested"] = {"cu130": "kernels-gpu: needs 1 GPU, 0 on this machine"}
    text = render_text(run).splitlines()
    assert text[1] == "PUBLISHED UNTESTED on its hardware: cu130 (kernels-gpu: needs 1 GPU, 0 on this machine)"
    assert "**PUBLISHED UNTESTED on its hardware: cu130" in render_markdown(run).splitlines()[2]


def test_markdown_summary_links_each_suites_table_of_problem_tests(tmp_path):
    run = make_run(tmp_path)
    run.info["test_table:test/kernels/cpu"] = {"url": "http://127.0.0.1:4200/artifacts/artifact/abc", "problems": 2,
                                               "summary": "40 passed, 1 failed, 1 flaky (test_x: failed: a | b)"}
    run.info["test_table:test/other/cpu"] = {"url": "", "problems": 0, "summary": "3 passed"}
    markdown = render_markdown(run)
    section = markdown.split("## Test results", 1)[1]
    assert ("| `test/kernels/cpu` | 40 passed, 1 failed, 1 flaky (test_x: failed: a \\| b) | "
            "[2 tests](http://127.0.0.1:4200/artifacts/artifact/abc) |") in section
    assert "| `test/other/cpu` | 3 passed | 0 |" in section
