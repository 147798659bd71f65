"""`test_flow` end to end under the session's Prefect server: units, reports, final state."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from release.errors import InvalidInputError
from release.manifest import RunManifest

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
timeout_s = 20

[publish]
default_target = "local"
[publish.targets.local]
url = "file://{out}/index"
"""

MIXED = '''
import os
from pathlib import Path

from release.errors import InfrastructureError


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
    from flows.test import test_flow

    out = tmp_path / "out"
    state = test_flow(config_path=str(project / "kiln.toml"), out=str(out), junit=str(tmp_path / "all.xml"),
                      json_path=str(tmp_path / "all.json"), return_state=True)
    assert state.is_failed()
    assert "1 of 2 units failed" in state.message

    run = RunManifest.load(out)
    units = {u.id: u for u in run.units}
    assert (units["test/good"].state, units["test/good"].message) == ("completed", "2 passed")
    mixed = units["test/mixed"]
    assert (mixed.state, mixed.suite, mixed.required) == ("failed", "mixed", False)
    assert mixed.message.startswith("1 passed, 1 flaky, 1 failed (test_fail: failed: assert (2 + 2) == 5")

    reports = {a.path: a for a in run.artifacts_of("report")}
    assert set(reports) == {"tests/good.junit.xml", "tests/good.json", "tests/mixed.junit.xml", "tests/mixed.json"}
    for artifact in reports.values():
        run.verify(artifact)  # the recorded sha256 matches the file
    assert json.loads((out / "tests" / "mixed.json").read_text())["counts"] == {"passed": 1, "flaky": 1, "failed": 1}

    combined = ET.parse(tmp_path / "all.xml").getroot()
    assert [s.get("name") for s in combined.iter("testsuite")] == ["good", "mixed"]
    assert [s["suite"] for s in json.loads((tmp_path / "all.json").read_text())["suites"]] == ["good", "mixed"]


def test_bad_overrides_fail_before_anything_is_written(prefect_server, project, tmp_path):
    from flows.test import test_flow

    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match="isolate='suite'"):
        test_flow(config_path=str(project / "kiln.toml"), out=str(out), isolate="suite")
    assert not out.exists()


@pytest.mark.slow
def test_selected_suites_only(prefect_server, project, tmp_path):
    from flows.test import test_flow

    out = tmp_path / "out"
    summary = test_flow(config_path=str(project / "kiln.toml"), out=str(out), suites=["good"])
    assert summary == {"total": 1, "completed": 1}
    assert [u.id for u in RunManifest.load(out).units] == ["test/good"]
