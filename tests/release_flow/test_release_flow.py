"""The release flow under the session's Prefect server, on the tiny project.

Bad parameters are refused before any build; a secret credential leaks into
no log, artifact or file; a release whose verification fails (fault
injection) leaves every index page byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

import kiln.flows.release as release_module
from kiln.core.dists import make_distribution
from kiln.core.errors import IntegrityError
from kiln.core.store import LocalStore
from kiln.flows.release import approved_release_flow, release_flow
from kiln.release.index.render import generate
from kiln.tasks.bench.harness import stats_of
from tests.helpers.gitrepo import init_repo
from tests.helpers.moto_iam import BUCKET, moto_server  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"


def _dist(filename: str):
    return make_distribution(filename, hashlib.sha256(filename.encode()).hexdigest(), 10, 1_700_000_000)


def _seed_pages(put, prefix: str, filenames: list[str]) -> None:
    for key, data in generate(map(_dist, filenames)).items():
        put(f"{prefix}/{key}", data)


@pytest.fixture
def project(tmp_path) -> Path:
    """A private copy of the tiny project, committed (its build cache and history stay in tmp)."""
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    return init_repo(root)


@pytest.fixture
def published(project, tmp_path) -> Path:
    """A run directory whose local release channel already holds 0.2.0."""
    out = tmp_path / "out"
    store = LocalStore(out / "index")
    _seed_pages(lambda k, d: store.put_page(k, d, "text/html", "no-cache", None), "release/cpu/simple",
                ["tiny_kernels-0.2.0+cpu-py3-none-any.whl"])
    return out


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"version": "0.3-beta-two"}, "is not a PEP 440 version"),
        ({"version": "0.2.0"}, "0.2.0 is already published on the release channel"),
        ({"version": "0.1.9"}, "lower than the last release release 0.2.0"),
        # Refused by Prefect's parameter validation from the Literal annotation, before the body runs.
        ({"version": "0.3.0", "channel": "beta"}, "channel: Input should be 'nightly' or 'release'"),
    ],
)
def test_bad_parameters_are_refused_before_any_build(prefect_server, project, published, params, needle):
    with pytest.raises(Exception) as info:
        approved_release_flow(config_path=str(project / "kiln.toml"), out=str(published), **params)
    assert needle in str(info.value)
    assert sorted(p.name for p in published.iterdir()) == ["index"]  # no run.json, no build/, no wheels/
    assert not (project / ".kiln").exists()  # the build cache was never touched


def _secret_project(project: Path, endpoint: str, block: str) -> Path:
    text = (project / "kiln.toml").read_text().replace('default_target = "local"', 'default_target = "s3"')
    text += (f'\n[publish.targets.s3]\nurl = "s3://{BUCKET}/simple"\nregion = "us-east-1"\nendpoint = "{endpoint}"\n'
             f'\n[permissions.publish-release]\nread = ["release/"]\nwrite = ["release/"]\n'
             f'credentials = {{ block = "{block}" }}\n')
    (project / "kiln.toml").write_text(text)
    return project / "kiln.toml"


def test_secret_credentials_never_leak(prefect_server, moto_server, project, tmp_path, caplog):  # noqa: F811
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler
    from prefect_aws import AwsCredentials

    secret = f"kiln-secret-{uuid.uuid4().hex}"
    block = f"kiln-publish-release-{uuid.uuid4().hex[:6]}"
    AwsCredentials(aws_access_key_id="AKIAKILNRELEASE", aws_secret_access_key=secret,
                   region_name="us-east-1").save(block)
    s3 = moto_server.admin("s3")
    s3.create_bucket(Bucket=BUCKET)
    _seed_pages(lambda k, d: s3.put_object(Bucket=BUCKET, Key=f"simple/{k}", Body=d), "release/cpu/simple",
                ["tiny_kernels-0.5.0+cpu-py3-none-any.whl"])
    config = _secret_project(project, moto_server.url, block)
    out = tmp_path / "out"

    state = approved_release_flow(version="0.4.0", config_path=str(config), out=str(out), return_state=True)
    # Refused as lower than 0.5.0: proof the channel was read with the block's session.
    assert state.is_failed() and "lower than the last release release 0.5.0" in state.message

    APILogHandler().flush()  # logs reach the API in batches; wait for them
    with get_client(sync_client=True) as client:
        mine = FlowRunFilterId(any_=[state.state_details.flow_run_id])
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=mine))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])))
        artifacts = client.read_artifacts()
    assert logs, "the run left no logs to check"
    texts = [log.message for log in logs] + [str(a.data) for a in artifacts] + [caplog.text, state.message]
    texts += [p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [t for t in texts if secret in t]


@pytest.mark.slow
def test_failed_verification_restores_every_page(prefect_server, project, published, monkeypatch):
    before = {p.relative_to(published): p.read_bytes() for p in (published / "index").rglob("index.*")}

    @release_module.task(name="verify-channel")
    def failing_verify(config_path: str, out: str, channel: str) -> None:  # the real task's signature
        # Fault injection: the real check would pass; this one says a hash is wrong.
        raise IntegrityError("fault injected by the test: a published hash does not match")

    monkeypatch.setattr(release_module, "verify_channel", failing_verify)
    state = approved_release_flow(version="0.3.0", config_path=str(project / "kiln.toml"), out=str(published),
                         return_state=True)
    assert state.is_failed() and "rolled back" in state.message
    wheels = list((published / "index").rglob("*0.3.0*.whl"))
    assert wheels, "the publish step never ran, so there was nothing to roll back"
    after = {p.relative_to(published): p.read_bytes() for p in (published / "index").rglob("index.*")}
    assert {k: after[k] for k in before} == before


def _paused_release(out: Path, deadline_s: float):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    end = time.monotonic() + deadline_s
    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
    with get_client(sync_client=True) as client:
        while time.monotonic() < end:
            for run in client.read_flow_runs(flow_run_filter=paused):
                if run.parameters.get("out") == str(out):
                    return run
            time.sleep(1)
    pytest.fail(f"no release run paused for approval within {deadline_s} s")


BENCHPROJ = REPO / "tests" / "bench" / "fixtures" / "benchproj"


@pytest.fixture
def benchproj(tmp_path) -> Path:
    """The torch-only bench project, committed: it builds in seconds and has real CPU benchmarks."""
    root = tmp_path / "benchproj"
    shutil.copytree(BENCHPROJ, root, ignore=shutil.ignore_patterns("__pycache__", "artifacts"))
    (root / ".gitignore").write_text("artifacts/\n")
    return init_repo(root) / "kiln.toml"


def _artifact(flow_run_id, key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])))
    assert found, f"run {flow_run_id} left no {key} artifact"
    return found[0].data


@pytest.mark.slow
@pytest.mark.timeout(900)  # two whole releases (build, tests, bench, publish, verify) on a busy 2-core machine
def test_a_noisy_cpu_release_passes_the_gate_first_and_is_the_next_releases_baseline(prefect_server, benchproj,
                                                                                    tmp_path):
    from kiln.tasks.bench.history import last_published
    from kiln.tasks.bench.results import iso_time, load_results
    from kiln.tasks.bench.trust import HistoryReader
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.runs import artifact_store
    from tests.helpers.benchfakes import keep

    out = tmp_path / "out"
    first = approved_release_flow(version="0.1.0", config_path=str(benchproj), out=str(out), return_state=True)
    assert first.is_completed(), first.message
    summary = _artifact(first.state_details.flow_run_id, "kiln-release-summary")
    assert ("benchmarks: no release published on the release channel with cpu results measured on cpu yet: "
            "nothing to compare against; the gate passes on build and tests") in summary
    config = load_config(benchproj)
    store = artifact_store(config)
    kept = last_published(HistoryReader(store, time.time()), config, "release", variant="cpu", metric="cpu")
    assert kept is not None and kept.run_id == str(first.state_details.flow_run_id)
    assert "benchmark results kept as the release channel's next baseline" in summary

    # The last release was twice as fast (a doctored copy of a release run started since): this CPU run regresses on
    # every case, and CPU timings are advisory by default, so the gate lists them and lets the release on.
    faster = tuple(c.model_copy(update={"stats": stats_of([s * 0.5 for s in c.stats.samples], c.name)})
                   for c in kept.cases)
    keep(store, config, kept.model_copy(update={"cases": faster, "run_id": "doctored-0_1_0",
                                                 "created": iso_time(time.time())}), channel="release")
    second = approved_release_flow(version="0.2.0", config_path=str(benchproj), out=str(out), return_state=True)
    assert second.is_completed(), second.message
    summary = _artifact(second.state_details.flow_run_id, "kiln-release-summary")
    assert "benchmarks compared with the last published release (run doctored-0_1_0" in summary
    assert "advisory regressions (4; only ['graph_replay'] timings block a release" in summary
    assert summary.count("[cpu] kernel/reference") == 4 and "noise ±" in summary
    results = load_results(out / str(second.state_details.flow_run_id) / "bench" / "results.json")
    assert results.flow == "release" and len(results.cases) == 4


@pytest.mark.slow
def test_a_rejected_release_ends_failed_with_a_summary_and_no_traceback(prefect_server, benchproj, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.flow_runs import resume_flow_run
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.logging.handlers import APILogHandler

    out = tmp_path / "out"
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(state=release_flow(
        version="0.3.0", dry_run=True, config_path=str(benchproj), out=str(out), return_state=True)))
    worker.start()
    run = _paused_release(out, deadline_s=600)
    description = read_flow_run_input(keyset_from_paused_state(run.state)["description"], flow_run_id=run.id)
    assert "Approve release `0.3.0` to the `release` channel?" in description
    assert "- dry run: yes" in description and "- to add: " in description
    assert "bench_kernels-0.3.0+cpu-py3-none-any.whl" in description and "pages would change" in description
    resume_flow_run(run.id, run_input={"approve": False, "comment": "wait for the driver update"})
    worker.join(timeout=600)
    assert not worker.is_alive(), "the release did not end within 600 s of its rejection"
    state = result["state"]
    assert state.is_failed()
    assert state.message == ("release 0.3.0: rejected by the approver: wait for the driver update; "
                             "nothing was published")
    summary = _artifact(run.id, "kiln-release-summary")
    assert "rejected by the approver: wait for the driver update" in summary and "## Publish to" in summary
    assert not (out / "index").exists()
    units = json.loads((out / str(run.id) / "run.json").read_text())["units"]
    assert units and not [u for u in units if u["stage"] == "publish"]  # the plan published nothing, not even a unit
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert logs and not [log.message for log in logs if "Traceback" in log.message
                         or "unexpected exception" in log.message]
