"""Test reports: JUnit XML (what CI dashboards read) and a JSON summary.

JUnit has only failure, error and skipped: ``failed`` maps to ``<failure>``;
timeouts, crashes and infrastructure faults map to ``<error>`` whose ``type``
says which (``timeout``, ``crashed:SIGSEGV``, ``infrastructure``); ``flaky``
is a passing testcase with a ``kiln.outcome`` property and the earlier
attempts in ``<system-err>``. Both files are written atomically.
"""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.core.fsutil import atomic_write_bytes, atomic_write_text
from kiln.tasks.testing.classify import TestResult, counts, first_line, suite_state, summary_line

# XML 1.0 cannot carry most control characters; test output often has them.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: str) -> str:
    return _INVALID_XML.sub("\ufffd", text)


def _split(nodeid: str) -> tuple[str, str]:
    """``tests/x/test_a.py::TestK::test_b[1]`` → (``tests.x.test_a.TestK``, ``test_b[1]``)."""
    path, _, rest = nodeid.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    parts = rest.split("::") if rest else [nodeid]
    return ".".join([module, *parts[:-1]]), parts[-1]


def _testcase(parent: ET.Element, result: TestResult) -> None:
    classname, name = _split(result.nodeid)
    case = ET.SubElement(parent, "testcase", classname=classname, name=name, time=f"{result.duration_s:.3f}")
    props = ET.SubElement(case, "properties")
    ET.SubElement(props, "property", name="kiln.outcome", value=result.outcome)
    ET.SubElement(props, "property", name="kiln.attempts", value=str(result.attempts))
    if result.outcome == "failed":
        ET.SubElement(case, "failure", message=_clean(result.message), type="assertion").text = _clean(result.details)
    elif result.outcome in ("error", "timeout", "crashed", "infrastructure"):
        kind = f"crashed:{result.signal}" if result.signal else result.outcome
        ET.SubElement(case, "error", message=_clean(result.message), type=kind).text = _clean(result.details)
    elif result.outcome == "skipped":
        ET.SubElement(case, "skipped", message=_clean(result.message))
    if result.stdout:
        ET.SubElement(case, "system-out").text = _clean(result.stdout)
    stderr = result.stderr + (f"\n{result.details}" if result.outcome == "flaky" else "")
    if stderr.strip():
        ET.SubElement(case, "system-err").text = _clean(stderr)


def _testsuite(root: ET.Element, suite: str, results: Sequence[TestResult], timestamp: float) -> None:
    tally = counts(results)
    node = ET.SubElement(
        root, "testsuite", name=suite, tests=str(len(results)),
        failures=str(tally.get("failed", 0)),
        errors=str(sum(tally.get(k, 0) for k in ("error", "timeout", "crashed", "infrastructure"))),
        skipped=str(tally.get("skipped", 0)),
        time=f"{sum(r.duration_s for r in results):.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(timestamp)),
    )
    for result in results:
        _testcase(node, result)


def junit_document(suites: Mapping[str, Sequence[TestResult]], timestamp: float | None = None) -> bytes:
    """One ``<testsuites>`` document with a ``<testsuite>`` per suite."""
    root = ET.Element("testsuites", name="kiln")
    for name, results in suites.items():
        _testsuite(root, name, results, timestamp or time.time())
    ET.indent(root)
    document: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return document


def junit_xml(suite: str, results: Sequence[TestResult], timestamp: float | None = None) -> bytes:
    return junit_document({suite: results}, timestamp)


def summary(suite: str, results: Sequence[TestResult], elapsed_s: float = 0.0) -> dict[str, Any]:
    return {
        "suite": suite,
        "state": suite_state(results),
        "summary": summary_line(results),
        "counts": counts(results),
        "elapsed_s": round(elapsed_s, 3),
        "tests": [
            {"nodeid": r.nodeid, "outcome": r.outcome, "duration_s": round(r.duration_s, 3), "message": r.message,
             "signal": r.signal, "attempts": r.attempts, "details": r.details, "touched": list(r.touched)}
            for r in results
        ],
    }


def touched_of(test: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``touched`` keys of one test of a JSON summary; () (no record) for a summary written before them."""
    keys = test.get("touched") or ()
    return tuple(str(k) for k in keys) if isinstance(keys, (list, tuple)) else ()


def write_junit(path: str | Path, suite: str, results: Sequence[TestResult]) -> Path:
    atomic_write_bytes(path, junit_xml(suite, results))
    return Path(path)


def write_json(path: str | Path, suite: str, results: Sequence[TestResult], elapsed_s: float = 0.0) -> Path:
    atomic_write_text(path, json.dumps(summary(suite, results, elapsed_s), indent=2) + "\n")
    return Path(path)


# What a release engineer reads first about a suite: every test that did not simply pass or skip.
PROBLEM_OUTCOMES: tuple[str, ...] = ("failed", "error", "timeout", "crashed", "infrastructure", "flaky")
PROBLEM_COLUMNS: tuple[str, ...] = ("name", "class", "outcome", "duration_s", "attempts", "message")


def problem_rows(results: Sequence[TestResult]) -> list[dict[str, object]]:
    """One row per failed, errored, timed-out, crashed or flaky test, worst first (a table artifact)."""
    rows = []
    for result in sorted((r for r in results if r.outcome in PROBLEM_OUTCOMES),
                         key=lambda r: (PROBLEM_OUTCOMES.index(r.outcome), r.nodeid)):
        classname, name = _split(result.nodeid)
        rows.append({"name": name, "class": classname, "outcome": result.outcome,
                     "duration_s": round(result.duration_s, 2), "attempts": result.attempts,
                     "message": first_line(result.message or result.details)})
    return rows
