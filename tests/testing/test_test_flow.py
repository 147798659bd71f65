"""`test_flow` end to end under the session's Prefect server: units, reports, final state."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.manifest import RunManifest
from kiln.flows.run.params import SuiteOptions
from tests.helpers.waiting import until

KILN_TOML = """
[project]
package = "pkg"
distribution = "pkg"
version = "1.0"
source = "pkg"
registry = "pkg.registry:registry"

[[variants]]
name = "cpu"
backend = "cpu"

[[suites]]
name = "good"
paths = ["tests/good"]

[[suites]]
name = "mixed"
paths = ["tests/mixed"]
required = false
test_timeout_s = 20

[publish]
default_target = "local"
[publish.targets.local]
url = "file://{out}/index"
"""

MIXED = '''
import os
from pathlib import Path

from kiln.core.errors import InfrastructureError


def test_pass():
    assert os.getcwd() == str(Path(__file__).resolve().parents[2])  # tests run from the project root


def test_fail():
    assert 2 + 2 == 5


def test_infra_then_pass():
    marker = Path(__file__).with_name("attempted")
    if not marker.exists():
        marker.write_text("1")
        raise InfrastructureError("rendezvous failed (injected)")
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for suite, text in (("good", "def test_one():\n    assert True\n\n\ndef test_two():\n    assert [] == []\n"),
                        ("mixed", MIXED)):
        (tmp_path / "tests" / suite).mkdir(parents=True)
        (tmp_path / "tests" / suite / f"test_{suite}.py").write_text(text)
    (tmp_path / "kiln.toml").write_text(KILN_TOML)
    return tmp_path


@pytest.mark.slow
def test_flow_records_a_unit_and_reports_per_suite_and_fails_on_a_failed_test(prefect_server, project, tmp_path):
    from kiln.flows.test import test_flow

    out = tmp_path / "out"
    state = test_flow(config_path=str(project / "kiln.toml"), out=str(out),
                      options=SuiteOptions(junit=str(tmp_path / "all.xml"), json_path=str(tmp_path / "all.json")),
                      return_state=True)
    assert state.is_failed()
    assert "1 of 2 units failed" in state.message

    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert (units["test/good/cpu"].state, units["test/good/cpu"].message) == ("completed", "2 passed")
    assert units["build/cpu/wheel"].state == "completed"  # kiln test builds the wheel it tests
    mixed = units["test/mixed/cpu"]
    assert (mixed.state, mixed.suite, mixed.required) == ("failed", "mixed", False)
    assert mixed.message.startswith("1 passed, 1 flaky, 1 failed (test_fail: failed: assert (2 + 2) == 5")

    reports = {a.path: a for a in run.artifacts_of("report")}
    assert set(reports) == {"tests/good.cpu.junit.xml", "tests/good.cpu.json", "tests/mixed.cpu.junit.xml",
                            "tests/mixed.cpu.json"}
    for artifact in reports.values():
        run.verify(artifact)  # the recorded sha256 matches the file
    assert json.loads((run.root / "tests" / "mixed.cpu.json").read_text())["counts"] == {
        "passed": 1, "flaky": 1, "failed": 1}

    combined = ET.parse(tmp_path / "all.xml").getroot()
    assert [s.get("name") for s in combined.iter("testsuite")] == ["good.cpu", "mixed.cpu"]
    assert [s["suite"] for s in json.loads((tmp_path / "all.json").read_text())["suites"]] == ["good.cpu", "mixed.cpu"]
    _check_ui(state.state_details.flow_run_id, run)


def _states(tasks) -> dict[str, str]:
    return {t.name: t.state.type.value for t in tasks if t.state is not None}


def _check_ui(flow_run_id, run: RunManifest) -> None:
    """What the Prefect UI shows: the failed suite's task run is red and carries its problem tests."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterName,
    )

    expected = {"test/good/cpu": "COMPLETED", "test/mixed/cpu": "FAILED"}
    with get_client(sync_client=True) as client:
        mine = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        # Task-run states reach the server through Prefect's events worker, after the flow returned.
        tasks = until(lambda: client.read_task_runs(flow_run_filter=mine, task_run_filter=TaskRunFilter(
            name=TaskRunFilterName(any_=list(expected)))), lambda ts: _states(ts) == expected)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    assert _states(tasks) == expected
    tables = {a.key: a for a in artifacts if a.key in ("kiln-tests-good-cpu", "kiln-tests-mixed-cpu")}
    mixed = tables["kiln-tests-mixed-cpu"]
    assert mixed.task_run_id == next(t.id for t in tasks if t.name == "test/mixed/cpu")  # linked to its task run
    rows = json.loads(mixed.data)
    assert [(r["name"], r["class"], r["outcome"]) for r in rows] == [
        ("test_fail", "tests.mixed.test_mixed", "failed"), ("test_infra_then_pass", "tests.mixed.test_mixed", "flaky")]
    assert rows[0]["message"].startswith("assert (2 + 2) == 5") and rows[0]["duration_s"] >= 0
    assert json.loads(tables["kiln-tests-good-cpu"].data) == []
    # The run's summary links each suite's table.
    link = run.info["test_table:test/mixed/cpu"]
    assert link["problems"] == 2 and link["url"].endswith(f"/artifacts/artifact/{mixed.id}")


def test_bad_overrides_fail_before_anything_is_written(prefect_server, project, tmp_path):
    from kiln.flows.test import test_flow

    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match="isolate='suite'"):
        test_flow(config_path=str(project / "kiln.toml"), out=str(out), options=SuiteOptions(isolate="suite"))
    assert not out.exists()


@pytest.mark.slow
def test_selected_suites_only(prefect_server, project, tmp_path):
    from kiln.flows.test import test_flow

    out = tmp_path / "out"
    state = test_flow(config_path=str(project / "kiln.toml"), out=str(out), suites=["good"], return_state=True)
    assert state.result() == {"total": 1, "completed": 1}
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    assert [u.id for u in run.units if u.stage == "test"] == ["test/good/cpu"]


def test_split_test_args_tells_paths_from_pytest_options(project, monkeypatch):
    from kiln.tasks.testing.suite import split_test_args

    monkeypatch.chdir(project / "tests")
    paths, options = split_test_args(["good", "mixed/test_mixed.py::test_pass", "-k", "one", "-x"], Path.cwd(),
                                     project)
    assert paths == ["tests/good", "tests/mixed/test_mixed.py::test_pass"]
    assert options == ["-k", "one", "-x"]
    with pytest.raises(InvalidInputError, match="'good/test_nope.py' does not exist"):
        split_test_args(["good/test_nope.py"], Path.cwd(), project)
    with pytest.raises(InvalidInputError, match="outside the project"):
        split_test_args([str(project.parent)], Path.cwd(), project)


@pytest.mark.slow
def test_kiln_test_with_paths_runs_them_as_one_isolated_suite(prefect_server, project, tmp_path, monkeypatch, capsys):
    from kiln.flows.cli import main

    monkeypatch.chdir(project)
    out = tmp_path / "out"
    status = main(["test", "--out", str(out), "--", "tests/mixed/test_mixed.py::test_pass",
                   "tests/good/test_good.py"])
    assert status == 0
    run = RunManifest.load(out / "latest")
    units = {u.id: u for u in run.units if u.stage == "test"}
    assert list(units) == ["test/adhoc/cpu"]  # the configured suites did not run
    assert units["test/adhoc/cpu"].message == "3 passed"  # test_pass in its own process: os.getcwd() is the root
    results = json.loads((run.root / "tests" / "adhoc.cpu.json").read_text())
    assert sorted(t["nodeid"] for t in results["tests"]) == [
        "tests/good/test_good.py::test_one", "tests/good/test_good.py::test_two",
        "tests/mixed/test_mixed.py::test_pass"]
    # Not a terminal: progress is one plain line per finished unit of each long stage.
    assert "[test] 1/1 test/adhoc/cpu: Completed" in capsys.readouterr().err
