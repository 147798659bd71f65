"""A flaky test through the real nightly: quarantined by the policy, its failure does not block publishing.

The tiny fixture gains a test that fails while a flag file exists. The history already holds two passing
runs of it on the same commit (their run records and outcomes written as a test stage writes them); the nightly's run fails it, so it
failed 1 of 3 on one commit: flaky. The nightly quarantines it, its suite is ``flaky`` instead of
``failed``, the CPU variant is published, and the summary and the Prefect UI say so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.record import Checkout, RunHeader, create_record
from kiln.tasks.project.config import load_config
from kiln.tasks.run.runs import artifact_store
from kiln.tasks.testing.flaky import RunOutcomes
from kiln.tasks.testing.provenance import record_outcomes
from kiln.tasks.testing.quarantine import read_quarantine, store_outcomes
from tests.helpers.gitrepo import git, git_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NODE = "tests/test_flag.py::test_fails_while_flagged"


@pytest.fixture
def flagged(tmp_path: Path) -> tuple[Path, Path]:
    """The tiny CPU project with a test that fails while ``flag`` exists; (kiln.toml, flag)."""
    flag = tmp_path / "fail-now"

    def edit(repo: Path) -> None:
        text = (repo / "kiln.toml").read_text()
        head, _, rest = text.partition("[[variants]]")
        (repo / "kiln.toml").write_text(head + '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n\n'
                                        + rest[rest.index("[build]"):]
                                        + "\n[testing.quarantine]\nwindow = 5\nrelease_after = 2\n")
        (repo / "tests" / "test_flag.py").write_text(
            "from pathlib import Path\n\n\n"
            f"def test_fails_while_flagged():\n    assert not Path({str(flag)!r}).exists(), 'flagged'\n")

    return git_project("tiny", tmp_path, edit=edit), flag


def _artifact(flow_run_id, key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
    assert found, f"run {flow_run_id} left no {key} artifact"
    return found[0].data if isinstance(found[0].data, str) else json.dumps(found[0].data)


def test_a_quarantined_failure_does_not_block_publishing_and_the_summary_says_so(prefect_server, flagged, tmp_path):
    from kiln.flows.nightly import nightly_flow
    from kiln.flows.report.summary import render_text

    config_path, flag = flagged
    config = load_config(config_path)
    commit = git(config_path.parent, "rev-parse", "HEAD")
    store, policy = artifact_store(config), config.testing.quarantine
    for i in range(2):  # two earlier nightlies of this commit passed it
        earlier = RunOutcomes(f"earlier-{i}", "test/tiny/cpu", commit, time.time() - 100 + i, {NODE: "pass"})
        header = RunHeader(earlier.run_id, "nightly", "0.1.0", Checkout(commit, 0, (), True), earlier.created)
        create_record(store, header, tmp_path / "earlier")
        record_outcomes(store, earlier)
        store_outcomes(store, policy, "tiny.cpu", earlier)
    flag.write_text("")
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config_path), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    suite = {u.id: u for u in run.units}["test/tiny/cpu"]
    assert suite.state == "flaky" and "1 failed" in suite.message
    line = f"quarantined: {NODE} (failed 1 of 3 on {commit[:12]}) — did not gate publishing"
    assert line in suite.message and line in render_text(run)
    assert f"- {line}" in _artifact(state.state_details.flow_run_id, "kiln-nightly-summary")
    page = out / "index" / "nightly" / "cpu" / "simple" / "tiny-kernels" / "index.json"
    assert any(f["filename"].endswith("+cpu-py3-none-any.whl") for f in json.loads(page.read_text())["files"])
    (entry,) = read_quarantine(store, policy).entries
    assert (entry.unit, entry.nodeid, [e.verdict for e in entry.record]) == ("test/tiny/cpu", NODE,
                                                                              ["pass", "pass", "fail"])
    assert NODE in _artifact(state.state_details.flow_run_id, "kiln-quarantine")  # the list in the Prefect UI
