"""The coverage table (issue 45, part 5): one row per requested cell, through the function the nightly and the
release call (``coverage_report``), on a real run record in a local artifact store, rendered by the summary.

A run of the tiny fixture (cu130, rocm, cpu): cu130 built and its GPU suite not run (no GPU), rocm not built
(a unit failed), cpu built and its suite failed; every requested cell has a row that says which.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from kiln.core.manifest import Unit
from kiln.core.record import RunHeader, RunRecord, create_record
from kiln.core.store import LocalStore
from kiln.flows.report.summary import render_markdown, render_text
from kiln.flows.run.common import coverage_report
from kiln.tasks.project.config import load_config
from kiln.tasks.run.coverage import COVERAGE_INFO, wheel_platform
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from tests.helpers.projects import copy_project

VERSION = "0.1.0.dev1"


def _wheel(view: Path, variant: str, tag: str, requires: list[str]) -> Path:
    version = f"{VERSION}+{variant}"
    metadata = f"Metadata-Version: 2.1\nName: tiny-kernels\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {line}\n" for line in requires)
    info = f"tiny_kernels-{version}.dist-info"
    members = [("tinyk/__init__.py", b""), (f"{info}/METADATA", metadata.encode()),
               (f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode())]
    return write_wheel(view / "wheels", f"tiny_kernels-{version}-{tag}.whl", members, WheelStamp())


def _run(tmp_path: Path) -> RunRecord:
    run = create_record(LocalStore(tmp_path / "artifacts"), RunHeader(run_id=uuid.uuid4().hex, flow="nightly",
                                                                      version=VERSION), tmp_path / "out")
    cu130 = _wheel(run.view, "cu130", "py3-none-manylinux_2_34_x86_64", ["torch==2.14.1", "triton==3.7.1"])
    cpu = _wheel(run.view, "cpu", "py3-none-any", ["torch>=2.6", "numpy"])
    run.add_artifact(cu130, step="build", kind="wheel", variant="cu130")
    run.add_artifact(cpu, step="build", kind="wheel", variant="cpu")
    run.record_all([
        Unit("build/cu130/wheel", "build", "completed", variant="cu130", message=cu130.name),
        Unit("build/rocm/wheel", "build", "skipped", variant="rocm", message="not built: 1 units of rocm failed"),
        Unit("build/cpu/wheel", "build", "completed", variant="cpu", message=cpu.name),
        Unit("test/kernels-gpu/cu130", "test", "not_run", variant="cu130", suite="kernels-gpu",
             message="no GPU on this machine"),
        Unit("test/kernels/cpu", "test", "failed", variant="cpu", suite="kernels",
             message="1 failed, 3 passed\ntests/test_add.py::test_add - AssertionError"),
    ])
    return run


def test_every_requested_cell_has_a_row_with_its_wheel_and_what_became_of_it(prefect_server, tmp_path):
    config = load_config(copy_project("tiny", tmp_path))
    run = _run(tmp_path)
    rows = {row["variant"]: row for row in coverage_report(config, run, "nightly")}
    assert list(rows) == ["cu130", "rocm", "cpu"]  # kiln.toml's order: every requested cell, built or not
    assert rows["cu130"] | {"why": ""} == {
        "variant": "cu130", "python": "py3", "torch": "==2.14.1", "backend": "cuda", "archs": "8.0 9.0",
        "wheel": f"tiny_kernels-{VERSION}+cu130-py3-none-manylinux_2_34_x86_64.whl", "state": "untested", "why": "",
        "platform": "x86_64"}
    assert rows["cu130"]["why"] == "kernels-gpu not run: no GPU on this machine"
    assert (rows["rocm"]["state"], rows["rocm"]["why"]) == ("not built", "not built: 1 units of rocm failed")
    assert (rows["rocm"]["wheel"], rows["rocm"]["torch"]) == ("-", "-")
    assert rows["rocm"]["platform"] == "x86_64"  # no wheel: what the variant asks for
    assert (rows["cpu"]["state"], rows["cpu"]["torch"]) == ("failed", ">=2.6")
    assert rows["cpu"]["why"] == "kernels: 1 failed, 3 passed"
    assert run.info()[COVERAGE_INFO] == list(rows.values())  # recorded with the run, for every later reader
    with get_client(sync_client=True) as client:  # and left as a table artifact in the Prefect UI
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["kiln-nightly-coverage"])), limit=1, sort=ArtifactSort.CREATED_DESC)
    assert run.run_id in (artifact.description or "") and "not built" in str(artifact.data)


def test_the_summary_shows_the_coverage_table_the_run_recorded(prefect_server, tmp_path):
    config = load_config(copy_project("tiny", tmp_path))
    run = _run(tmp_path)
    coverage_report(config, run, "nightly")
    manifest = run.manifest()
    markdown = render_markdown(manifest)
    assert "## Coverage" in markdown
    assert "| rocm | - | - | hip | x86_64 | gfx942 | - | not built | not built: 1 units of rocm failed |" in markdown
    assert f"| cpu | py3 | >=2.6 | cpu | any | - | tiny_kernels-{VERSION}+cpu-py3-none-any.whl | failed |" in markdown
    text = render_text(manifest)
    assert "coverage:" in text and "cu130  untested" in text and "torch ==2.14.1, cuda [8.0 9.0] " in text
    assert f"cpu [-] any  tiny_kernels-{VERSION}+cpu-py3-none-any.whl" in text


@pytest.mark.parametrize(("filename", "cpu"), [
    ("crossdot-0.1.0-cp311-cp311-manylinux_2_28_aarch64.whl", "aarch64"),
    ("crossdot-0.1.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "x86_64"),
    ("tiny_kernels-0.1.0-py3-none-any.whl", "any"),
])
def test_a_rows_platform_is_the_cpu_its_wheels_tags_name(filename: str, cpu: str) -> None:
    assert wheel_platform(filename) == cpu
