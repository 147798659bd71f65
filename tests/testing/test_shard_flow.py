"""A suite split into two shards through ``test_flow``: units, reports, the partition by recorded durations,
a failing shard, the balance line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.store import open_store
from kiln.flows.report.summary import render_text
from kiln.tasks.testing.shards import partition, read_durations

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "suites" / "sharded"

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
name = "many"
paths = ["tests/many"]
shards = 2
required = false

[testing.selection]
enabled = false  # every run runs every test: this is about how they are split, not which are carried

[publish]
default_target = "local"
[publish.targets.local]
url = "file://{out}/index"
"""

FAILING = "def test_fails():\n    assert 2 + 2 == 5\n"
# Collection order: the fixture's file, then the failing one.
IDS = [f"tests/many/test_sleeps.py::test_sleep[{n}]" for n in range(40)] + ["tests/many/test_zfails.py::test_fails"]
SHARDS = ("shard-1-of-2", "shard-2-of-2")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    shutil.copytree(FIXTURE, tmp_path / "tests" / "many")
    (tmp_path / "tests" / "many" / "test_zfails.py").write_text(FAILING)
    (tmp_path / "kiln.toml").write_text(KILN_TOML)
    return tmp_path


def _run(project: Path, out: Path) -> RunManifest:
    from kiln.flows.test import test_flow

    state = test_flow(config_path=str(project / "kiln.toml"), out=str(out), return_state=True)
    assert state.is_failed(), state.message  # the shard holding the failing test fails
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _shard_tests(run: RunManifest) -> dict[str, list[str]]:
    """Each shard's tests, as its own report lists them."""
    found = {}
    for shard in SHARDS:
        report = json.loads((run.root / "tests" / f"many.cpu.{shard}.json").read_text())
        found[shard] = [t["nodeid"] for t in report["tests"]]
    return found


@pytest.mark.slow
def test_two_shards_report_every_test_once_split_by_the_durations_the_first_run_recorded(prefect_server, project,
                                                                                         tmp_path):
    store = open_store("file://.kiln/artifacts", root=project)
    first = _run(project, tmp_path / "out")
    units = {u.id: u for u in first.units if u.stage == "test"}
    assert set(units) == {f"test/many/cpu/{shard}" for shard in SHARDS}
    assert {a.path for a in first.artifacts_of("report")} == {
        f"tests/many.cpu.{shard}.{ext}" for shard in SHARDS for ext in ("json", "junit.xml")}
    tests = _shard_tests(first)
    assert sorted(tests[SHARDS[0]] + tests[SHARDS[1]]) == sorted(IDS)  # every test reported, and only once
    # No history yet: dealt round-robin by collection order; the failing test (41st) is shard 1's, which fails
    # and reports its own tests; shard 2 passes.
    assert tests == {SHARDS[0]: IDS[0::2], SHARDS[1]: IDS[1::2]}
    failed, passed = units["test/many/cpu/shard-1-of-2"], units["test/many/cpu/shard-2-of-2"]
    assert (failed.state, passed.state) == ("failed", "completed")
    assert failed.message.startswith("20 passed, 1 failed (test_fails") and passed.message.startswith("20 passed")
    assert "test/many/cpu: 2 shards, walls" in render_text(first)
    # the two shards ran in this process and shared one environment, made once for the suite by whichever came first
    made = [p.name for p in (first.root / "tests" / ".envs").iterdir()]
    assert len(made) == 1 and made[0] in {f"many.cpu.{shard}" for shard in SHARDS}, made

    recorded = read_durations(store, "test-history", "many.cpu")
    assert set(recorded) == set(IDS)  # each test's duration, whichever shard ran it
    second = _run(project, tmp_path / "out")
    tests = _shard_tests(second)
    assert [tuple(tests[shard]) for shard in SHARDS] == partition(IDS, recorded, 2)  # longest first, by history
    assert sorted(tests[SHARDS[0]] + tests[SHARDS[1]]) == sorted(IDS)
    balance = next(line for line in render_text(second).splitlines() if "2 shards, walls" in line)
    assert "balance" in balance and "(slowest / mean)" in balance
