"""The console ending of a nightly fits one screen: a table per variant, then one install command per variant.

The run is the default project's shape (cpu, cu130 and rocm variants; 109 compile units; a CPU suite, a
distributed suite, a GPU suite not run on this machine; benchmarks), its wheels published with the real
publish protocol into a local index and its install facts read from what was published, as the publish
step does. The printed cpu command is run into a fresh virtual environment.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest, Unit
from kiln.core.store import LocalStore
from kiln.flows.report.console import TABLE_WIDTH, variant_index
from kiln.flows.report.hint import install_command
from kiln.flows.report.summary import render_console, render_text
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.tasks.install_hint import install_facts
from tests.flows.test_install_hint import _pip_install, extra_index
from tests.helpers.wheelkit import make_wheel

VERSION = "0.1.0.dev20261207050000"
VARIANTS = ("cpu", "cu130", "rocm")
SCREEN_COLUMNS, SCREEN_ROWS = 120, 40


def _units(run: RunManifest) -> None:
    for variant, count in (("cu130", 54), ("rocm", 54), ("cpu", 1)):  # 109 compile units, as the default project
        for i in range(count):
            run.add_unit(Unit(f"build/{variant}/9.0/kernel{i}/fp16", "build", "completed", variant=variant,
                              arch="9.0", duration_s=3.0))
    run.add_unit(Unit("test/kernels/cpu", "test", "completed", variant="cpu", suite="kernels",
                      message="40 passed, 2 skipped"))
    run.add_unit(Unit("test/distributed/cpu", "test", "completed", variant="cpu", suite="distributed",
                      message="9 passed"))
    run.info["selection:test/kernels/cpu"] = ["test/kernels/cpu: selection: 30 run, 10 carried from run 1a2b3c4d; "
                                              "cpu-seconds not spent: 12.0"]
    for variant in ("cu130", "rocm"):
        run.add_unit(Unit(f"test/kernels-gpu/{variant}", "test", "not_run", variant=variant, suite="kernels-gpu",
                          message="not run: needs 1 GPU, 0 on this machine"))
    run.add_unit(Unit("bench/cpu", "bench", "completed", variant="cpu", message="6 cases"))


def nightly_run(tmp_path: Path) -> RunManifest:
    """A nightly of three variants, every variant's wheel published, with the facts the publish step records."""
    run = RunManifest(tmp_path / "run", "5f3c2a10-run", flow="nightly", version=VERSION)
    run.info["commit"] = "c0ffee0123456789abcdef0123456789abcdef01"
    _units(run)
    for variant in VARIANTS:
        tag = "py3-none-any" if variant == "cpu" else "py3-none-manylinux_2_28_x86_64"
        wheel = make_wheel(tmp_path / "run" / "wheels" / variant, "demo-kernels", f"{VERSION}+{variant}",
                           requires=("demo-runtime==1.0",), tag=tag)
        run.add_artifact(wheel, step="build", kind="wheel", variant=variant)
    runtime = make_wheel(tmp_path / "runtime", "demo-runtime", "1.0")
    plan = publish(run, LocalStore(tmp_path / "index"),
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=list(VARIANTS),
                                  extra=[(None, runtime)], untested_ok=["kernels-gpu"]))
    run.info["index_url"] = sorted({f"{plan.target}/{u.index}/" for u in plan.uploads})
    pypi = extra_index(tmp_path / "pypi", ["0.0.1"]).as_uri()  # stands for PyPI: nothing leaves the machine
    run.info["install"] = install_facts("demo-kernels", [pypi], plan, check=False)
    run.info["published_untested"] = {v: "kernels-gpu: needs 1 GPU, 0 on this machine" for v in ("cu130", "rocm")}
    run.info["publish_plan"] = plan.to_markdown()  # the channel's whole file list: not on the console
    return run


def _rows(text: str, columns: int) -> int:
    """Terminal rows the text takes at ``columns``: a longer line wraps."""
    return sum(max(1, math.ceil(len(line) / columns)) for line in text.splitlines())


@pytest.fixture
def nightly(tmp_path) -> RunManifest:
    return nightly_run(tmp_path)


def test_the_console_ending_of_a_three_variant_nightly_fits_one_screen(nightly):
    text = render_console(nightly)
    assert _rows(text, SCREEN_COLUMNS) <= SCREEN_ROWS, text
    assert _rows(render_text(nightly), SCREEN_COLUMNS) > SCREEN_ROWS  # the whole text form does not: the premise


def test_the_table_has_one_row_per_variant_within_the_width(nightly):
    lines = render_console(nightly).splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["variant", "wheel", "tests", "published",
                                                                        "index"])
    table = lines[start:start + 1 + len(VARIANTS)]
    assert all(len(line) <= TABLE_WIDTH for line in table), table
    rows = {line.split()[0]: line for line in table[1:]}
    assert list(rows) == list(VARIANTS)
    assert [cell.strip() for cell in rows["cpu"].split("  ") if cell.strip()] == [
        "cpu", "built", "39 passed, 10 carried", "yes", "cpu/simple/"]
    assert "1 suite not run" in rows["cu130"] and "untested" in rows["cu130"] and "cu130/simple/" in rows["cu130"]


def test_every_variants_install_command_is_printed_once_and_is_the_hints(nightly):
    text = render_console(nightly)
    install = nightly.info["install"]
    for variant in VARIANTS:
        url = variant_index(nightly.info["index_url"], variant)
        assert text.count(f"  install {variant}: {install_command(url, install)}\n") == 1
    assert "this index holds" not in text  # the explanations stay in the record, the artifact and `kiln which`
    assert "already present" not in text and "- to add" not in text  # the publish plan's file list too


def test_a_failed_build_shows_in_its_variants_row_and_needs_attention_is_capped(nightly):
    for i in range(12):
        nightly.add_unit(Unit(f"build/cu130/8.0/broken{i}/fp16", "build", "failed", variant="cu130", arch="8.0",
                              message="ptxas error\n" + "\n".join(f"log line {n}" for n in range(20))))
    for arch, n in (("8.0", 6), ("gfx90a", 6)):  # skips the arch filter made on purpose
        for i in range(n):
            nightly.add_unit(Unit(f"build/x/{arch}/k{i}/fp8", "build", "skipped", variant="cu130", arch=arch,
                                  message=f"specialization 'k{i}' needs arch > {arch}"))
    text = render_console(nightly)
    (skipped,) = [line for line in text.splitlines() if line.startswith("  SKIPPED ")]  # one row for every reason
    assert skipped == "  SKIPPED   specialization '…' needs arch > 8.0 ×6; specialization '…' needs arch > gfx90a ×6"
    row = next(line for line in text.splitlines() if line.startswith("  cu130 "))
    assert "FAILED 12/78" in row
    assert text.count("  FAILED    build/cu130") == 5 and "… and 9 more" in text  # 12 failed, 2 not run
    assert _rows(text, SCREEN_COLUMNS) <= SCREEN_ROWS, text


def test_the_combined_variant_index_leads_with_its_uv_command_and_kiln_which(nightly):
    combined = f"{nightly.info['index_url'][0].split('/nightly/')[0]}/nightly/wheel-variants/simple/"
    nightly.info["index_url"] = [*nightly.info["index_url"], combined]
    facts = dict(next(iter(nightly.info["install"]["indexes"].values())), variants=True)
    nightly.info["install"] = {**nightly.info["install"],
                               "indexes": {**nightly.info["install"]["indexes"], combined: facts}}
    text = render_console(nightly)
    uv = f"  install (uv picks this machine's variant): {install_command(combined, nightly.info['install'])}"
    assert uv in text and f"kiln which {combined} --python" in text
    assert text.index(uv) < text.index("  install cpu: ")  # pip's per-variant commands follow
    assert _rows(text, SCREEN_COLUMNS) <= SCREEN_ROWS, text


@pytest.mark.slow
def test_the_printed_cpu_command_installs_the_nightly(nightly, tmp_path):
    import subprocess
    import sys

    line = next(line for line in render_console(nightly).splitlines() if line.startswith("  install cpu: "))
    command = line.removeprefix("  install cpu: ")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=300)
    assert _pip_install(tmp_path / "venv" / "bin" / "python", command, tmp_path) == f"{VERSION}+cpu"
