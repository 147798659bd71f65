"""One configured test suite, end to end: options, isolated run, reports, unit.

This is what the test stage's Prefect task calls; it turns a ``[[suites]]``
entry of ``kiln.toml`` plus the command line's overrides into a run of
:func:`tasks.isolate.run_tests`, writes ``<out>/tests/<suite>.junit.xml`` and
``.json``, and returns the manifest unit that says how the suite went.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from release.fsutil import atomic_write_bytes, atomic_write_text
from release.manifest import Unit
from tasks.classify import TestResult, suite_state, summary_line
from tasks.config import KilnConfig, Suite
from tasks.devices import detect_gpu_count
from tasks.isolate import PRELOAD, Isolation, RunOptions, run_tests
from tasks.reports import junit_document, summary, write_json, write_junit

logger = logging.getLogger("kiln.test.suite")


@dataclass(frozen=True)
class SuiteRun:
    suite: str
    results: tuple[TestResult, ...]
    unit: Unit
    reports: tuple[Path, ...]
    elapsed_s: float


def check_overrides(isolate: str, timeout: float | None, retries: int) -> None:
    """Refuse bad command-line overrides (InvalidInputError) before a run starts."""
    RunOptions(isolate=isolate, timeout_s=1.0 if timeout is None else timeout, retries=retries)  # type: ignore[arg-type]


def suite_options(config: KilnConfig, suite: Suite, *, isolate: Isolation = "test", timeout: float | None = None,
                  retries: int = 1, pytest_args: Sequence[str] = (), gpus: int | None = None,
                  env: Mapping[str, str] | None = None) -> RunOptions:
    """The runner's options: the suite's markers and timeout unless overridden.

    A suite may use at most the GPUs it declares (that is what its Prefect
    concurrency slots cover), and never more than the machine has.
    """
    devices = min(detect_gpu_count() if gpus is None else gpus, suite.gpus)
    preload = (*PRELOAD, config.project.package)
    return RunOptions(isolate=isolate, timeout_s=suite.timeout_s if timeout is None else timeout, retries=retries, markers=suite.markers,
                      pytest_args=tuple(pytest_args), gpus=devices, env=dict(env or {}), preload=preload)


def run_suite(config: KilnConfig, suite: Suite, out: str | Path, options: RunOptions) -> SuiteRun:
    """Run ``suite`` in isolation and write its reports under ``<out>/tests``."""
    reports_dir = Path(out).resolve() / "tests"
    start = time.monotonic()
    logger.info("suite %s: running %s (isolate=%s, timeout=%gs per test)", suite.name, list(suite.paths),
                options.isolate, options.timeout_s)
    results = run_tests(suite.paths, config.root, reports_dir / ".work" / suite.name, options)
    elapsed = time.monotonic() - start
    junit = write_junit(reports_dir / f"{suite.name}.junit.xml", suite.name, results)
    report = write_json(reports_dir / f"{suite.name}.json", suite.name, results, elapsed)
    unit = Unit(id=f"test/{suite.name}", stage="test", state=suite_state(results), suite=suite.name,
                message=summary_line(results), duration_s=elapsed, required=suite.required)
    logger.info("suite %s: %s", suite.name, unit.message)
    return SuiteRun(suite.name, tuple(results), unit, (junit, report), elapsed)


def write_combined(runs: Sequence[SuiteRun], junit: str | Path | None, json_path: str | Path | None) -> list[Path]:
    """The ``--junit`` / ``--json`` files: every suite of the run in one document each."""
    written = []
    if junit:
        atomic_write_bytes(junit, junit_document({r.suite: r.results for r in runs}))
        written.append(Path(junit))
    if json_path:
        doc = {"suites": [summary(r.suite, r.results, r.elapsed_s) for r in runs]}
        atomic_write_text(json_path, json.dumps(doc, indent=2) + "\n")
        written.append(Path(json_path))
    return written
