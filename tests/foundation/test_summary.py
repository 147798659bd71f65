"""The end-of-run summary says what a release engineer must read first."""

from __future__ import annotations

from pathlib import Path

from flows.summary import render_markdown, render_text
from release.manifest import RunManifest, Unit


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


def test_markdown_summary_has_a_row_per_stage_and_escapes_pipes(tmp_path):
    run = make_run(tmp_path)
    run.add_unit(Unit("test/x", "test", "failed", message="a | b"))
    markdown = render_markdown(run)
    assert "| build | 3 | 1 failed, 1 skipped, 1 completed |" in markdown
    assert "a \\| b" in markdown
