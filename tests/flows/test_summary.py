"""The end-of-run summary says what a release engineer must read first."""

from __future__ import annotations

from pathlib import Path

from kiln.core.manifest import RunManifest, Unit
from kiln.flows.report.summary import render_markdown, render_text


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


def test_a_failure_line_carries_the_last_lines_of_its_log(tmp_path):
    run = make_run(tmp_path)
    log = [f"compiling step {i}" for i in range(20)] + ["error: undefined symbol quant_fp8"]
    run.add_unit(Unit("build/cpu/-/demo/pep517", "build", "failed", variant="cpu",
                      message="CompileError: the build backend failed for demo (exit 1); its log ends:\n" + "\n".join(log)))
    text = render_text(run)
    line = text.index("FAILED    build/cpu/-/demo/pep517  CompileError: the build backend failed")
    tail = text[line:].splitlines()[1:7]
    assert [row.split("| ", 1)[1] for row in tail] == log[-6:]
    assert "compiling step 13" not in text  # the last lines, not the whole log
    markdown = render_markdown(run)
    assert "```text\n" + "\n".join(log[-6:]) + "\n```" in markdown
    assert "`build/cu130/8.0/quant/b` — ptxas error — its log ends:" in markdown  # a two-line message: its one line


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


def test_the_display_orders_cover_every_state_and_stage():
    from typing import get_args

    from kiln.core.manifest import Stage, UnitState
    from kiln.flows.report.summary import STAGE_ORDER, STATE_ORDER

    assert sorted(STATE_ORDER) == sorted(get_args(UnitState))
    assert STAGE_ORDER == get_args(Stage)


def test_a_variant_published_untested_is_named_in_the_first_lines(tmp_path):
    run = make_run(tmp_path)
    run.info["published_untested"] = {"cu130": "kernels-gpu: needs 1 GPU, 0 on this machine"}
    run.info["published_without_suite"] = {"cpu": "no suite covers cpu"}
    text = render_text(run).splitlines()
    assert text[1] == "PUBLISHED UNTESTED on its hardware: cu130 (kernels-gpu: needs 1 GPU, 0 on this machine)"
    assert text[2] == "PUBLISHED UNTESTED: no suite covers cpu"
    markdown = render_markdown(run)
    assert "**PUBLISHED UNTESTED on its hardware: cu130" in markdown.splitlines()[2]
    assert "**PUBLISHED UNTESTED: no suite covers cpu**" in markdown.splitlines()[4]
    attention = markdown.split("## Needs attention", 1)[1]
    assert "| `publish/cpu` | untested | published untested: no suite covers cpu |" in attention
    assert "| `publish/cu130` | untested | published untested: kernels-gpu: needs 1 GPU" in attention


# The twelve skips the default project's arch filter makes on purpose (what its build records).
FP8_SKIPS = [(variant, arch, f"specialization '{dtype}_fp8_b{block}' needs {backend} arch >= {minimum}")
             for variant, arch, backend, minimum in (("cu130", "8.0", "cuda", "8.9"), ("rocm", "gfx90a", "hip", "gfx942"))
             for dtype in ("fp32", "fp16", "bf16") for block in (512, 2048)]


def test_expected_skips_collapse_into_one_line_per_reason_with_the_table_behind_a_link(tmp_path):
    run = RunManifest(tmp_path, "r1", flow="nightly", version="0.1.0.dev1")
    for variant, arch, message in FP8_SKIPS:
        name = message.split("'")[1]
        run.add_unit(Unit(f"build/{variant}/{arch}/quant/{name}", "build", "skipped", variant=variant, arch=arch,
                          kernel="quant", message=message))
    run.add_unit(Unit("test/kernels-gpu/cu130", "test", "not_run", variant="cu130", suite="kernels-gpu",
                      message="not run: needs 1 GPU, 0 on this machine"))
    text = render_text(run)
    skipped = [line.strip() for line in text.splitlines() if line.strip().startswith("SKIPPED")]
    assert skipped == [
        "SKIPPED   6 units skipped: specialization '…' needs cuda arch >= 8.9 "
        "(bf16_fp8_b2048, bf16_fp8_b512, fp16_fp8_b2048 and 3 more; cu130 8.0)",
        "SKIPPED   6 units skipped: specialization '…' needs hip arch >= gfx942 "
        "(bf16_fp8_b2048, bf16_fp8_b512, fp16_fp8_b2048 and 3 more; rocm gfx90a)",
    ]
    assert "NOT_RUN   test/kernels-gpu/cu130  not run: needs 1 GPU" in text
    markdown = render_markdown(run, units_table="http://ui/artifacts/artifact/7")
    attention = markdown.split("## Needs attention", 1)[1]
    assert "| `test/kernels-gpu/cu130` | not_run |" in attention
    assert "build/cu130/8.0/quant" not in attention  # no row per skipped unit
    assert "(every unit and its reason: [the table of every unit](http://ui/artifacts/artifact/7))" in attention
    assert "- 6 units skipped: specialization '…' needs hip arch >= gfx942" in attention


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


def test_a_step_whose_machine_could_not_confine_package_code_needs_attention_and_every_step_says_how(tmp_path):
    """The records are what each step writes (``kiln.core.sandbox.confinement``); the second is a kernel without
    Landlock or namespaces, as a worker on an old kernel would record it."""
    from kiln.core.sandbox import CONFINEMENT_INFO
    from kiln.flows.report.summary import render_console

    run = make_run(tmp_path)
    run.info[f"{CONFINEMENT_INFO}build@node-a"] = {"landlock_abi": 7, "namespaces": True, "network": "none",
                                                   "gaps": []}
    run.info[f"{CONFINEMENT_INFO}test@old-node"] = {
        "landlock_abi": 0, "namespaces": False, "network": "loopback",
        "gaps": ["Landlock (files: the guest can read the user's home and Kiln's state)",
                 "network and user namespaces (unshare: EPERM: the guest reaches the network)"]}
    console, text, markdown = render_console(run), render_text(run), render_markdown(run)
    unconfined = ("UNCONFINED test@old-node  package code ran without Landlock (files: the guest can read the user's"
                  " home and Kiln's state); network and user namespaces (unshare: EPERM: the guest reaches the network)")
    assert unconfined in text and unconfined[:150] in console  # the console cuts a message at 160 characters
    assert "build@node-a" not in console  # a confined step needs no attention
    assert "    build@node-a: Landlock ABI 7, namespaces of its own (no network)\n" in text
    assert "    test@old-node: no Landlock, no namespaces of its own — NOT fully confined" in text
    assert "| `test@old-node` | unconfined | package code ran without Landlock" in markdown
    assert "## Package code sandbox" in markdown and "- build@node-a: Landlock ABI 7" in markdown
