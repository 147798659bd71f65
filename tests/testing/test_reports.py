"""kiln.tasks.testing.reports: JUnit XML a dashboard can read, and the JSON summary."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from kiln.tasks.testing.classify import TestResult
from kiln.tasks.testing.reports import junit_document, write_json, write_junit

RESULTS = [
    TestResult("tests/k/test_a.py::test_ok", "passed", 0.5, stdout="hello\n"),
    TestResult("tests/k/test_a.py::TestK::test_bad[2]", "failed", 0.1, "assert 1 == 2", "E assert 1 == 2"),
    TestResult("tests/k/test_a.py::test_err", "error", 0.1, "RuntimeError: x", "Traceback..."),
    TestResult("tests/k/test_a.py::test_hang", "timeout", 2.0, "timed out after 2s", "File test_a.py line 9"),
    TestResult("tests/k/test_a.py::test_segv", "crashed", 0.2, "crashed with SIGSEGV", "Fatal Python error", "SIGSEGV"),
    TestResult("tests/k/test_a.py::test_lost", "infrastructure", 0.2, "worker lost"),
    TestResult("tests/k/test_a.py::test_gpu", "skipped", 0.0, "needs 2 GPUs, 0 available"),
    TestResult("tests/k/test_a.py::test_flaky", "flaky", 0.3, "passed on attempt 2", "attempt 1: infrastructure",
               attempts=2),
]


def _cases(xml: bytes) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    return {case.get("name"): case for case in root.iter("testcase")}


def test_junit_counts_match_the_testcases():
    suite = ET.fromstring(junit_document({"kernels": RESULTS})).find("testsuite")
    assert suite is not None
    assert (suite.get("name"), suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "kernels", "8", "1", "4", "1")


def test_junit_maps_each_outcome_to_the_element_dashboards_read():
    cases = _cases(junit_document({"kernels": RESULTS}))
    assert cases["test_ok"].find("failure") is None and cases["test_ok"].find("error") is None
    assert cases["test_ok"].findtext("system-out") == "hello\n"
    assert cases["test_bad[2]"].find("failure").get("message") == "assert 1 == 2"
    assert cases["test_bad[2]"].get("classname") == "tests.k.test_a.TestK"
    assert cases["test_hang"].find("error").get("type") == "timeout"
    assert cases["test_segv"].find("error").get("type") == "crashed:SIGSEGV"
    assert cases["test_lost"].find("error").get("type") == "infrastructure"
    assert cases["test_gpu"].find("skipped").get("message") == "needs 2 GPUs, 0 available"
    flaky = cases["test_flaky"]
    assert flaky.find("failure") is None and flaky.find("error") is None
    assert {p.get("name"): p.get("value") for p in flaky.iter("property")} == {
        "kiln.outcome": "flaky", "kiln.attempts": "2"}
    assert "attempt 1: infrastructure" in flaky.findtext("system-err")


def test_control_characters_in_output_do_not_break_the_xml():
    xml = junit_document({"s": [TestResult("t.py::t", "failed", message="bad \x1b[31mred\x00", details="\x07")]})
    assert ET.fromstring(xml) is not None


def test_several_suites_share_one_document():
    root = ET.fromstring(junit_document({"a": RESULTS[:1], "b": RESULTS[1:2]}))
    assert [s.get("name") for s in root.iter("testsuite")] == ["a", "b"]


def test_written_files_hold_the_reports(tmp_path):
    junit = write_junit(tmp_path / "r" / "kernels.junit.xml", "kernels", RESULTS)
    summary = json.loads(write_json(tmp_path / "r" / "kernels.json", "kernels", RESULTS, 3.25).read_text())
    assert len(_cases(junit.read_bytes())) == 8
    assert summary["state"] == "failed"
    assert summary["counts"] == {"passed": 1, "flaky": 1, "failed": 1, "error": 1, "skipped": 1, "timeout": 1,
                                 "crashed": 1, "infrastructure": 1}
    assert summary["tests"][4]["signal"] == "SIGSEGV"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["kernels.json", "kernels.junit.xml"]
