"""Prefect operations against a real server, following the deploy-and-release guide (docs/guides/deploying.md).

The module runs the guide's own commands, in order, against a fresh server:
the work pools, ``prefect deploy --all`` (which must exit 0), a process
worker, and the guide's two ``prefect deployment run release/release``
commands (a dry run, then the release) pointed at a committed copy of the
tiny project. Each run pauses for approval; the test approves it through the
API, as a person would in the UI, after reading the plan the pause shows. A
nightly whose build is made to fail runs beside them, and the results are
read back through the Prefect API client.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.helpers.gitrepo import git_project
from tests.helpers.prefect_server import REPO, PrefectServer

from .test_readme import readme_commands

# A real server, a worker and deployments: setup alone takes minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BROKEN = REPO / "tests" / "fixtures" / "projects" / "broken" / "kiln.toml"
RUN_ID = re.compile(r"UUID:\s*([0-9a-f-]{36})")


@pytest.fixture(scope="module")
def deployed(real_server: PrefectServer) -> PrefectServer:
    """The guide's deploy commands, verbatim and in order, on a fresh server."""
    for words in readme_commands():
        if words[0] == "kiln" or words[:3] == ["prefect", "deployment", "run"]:
            continue  # the release itself: started by ``triggered``; `kiln release` has flow tests of its own
        if words[:3] == ["prefect", "config", "set"]:
            continue  # the fixture's environment already points every command at its server (a free port)
        if words[-1] == "&":
            real_server.start("worker", *words[1:-1], "--limit", "2")
            continue
        proc = real_server.cli(*words[1:], timeout=240, check=False)
        assert proc.returncode == 0, f"deploy guide command {shlex.join(words)} exited {proc.returncode}:\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return real_server


def _deployment_run(server: PrefectServer, words: list[str], **overrides: str) -> str:
    """Run a deploy guide ``prefect deployment run`` command plus ``overrides``; the flow run's id."""
    extra = [arg for name, value in overrides.items() for arg in ("--param", f"{name}={value}")]
    proc = server.cli(*words[1:], *extra)
    match = RUN_ID.search(proc.stdout)
    assert match, proc.stdout
    return match.group(1)


def test_deployments_carry_schedule_schema_and_limits(deployed, triggered):
    # ``triggered`` only starts the runs early; the tests below wait for them.
    with deployed.client() as client:
        gpu_pool = client.read_work_pool("kiln-gpu")
        release = client.read_deployment_by_name("release/release")
        nightly = client.read_deployment_by_name("nightly/nightly")
        gpu = client.read_deployment_by_name("test/kiln-gpu")
    assert release.enforce_parameter_schema
    assert release.global_concurrency_limit is not None and release.global_concurrency_limit.limit == 1
    schema = release.parameter_openapi_schema
    assert sorted(schema["properties"]["channel"]["enum"]) == ["nightly", "release"]  # the Channel closed set
    assert schema["required"] == ["version"]
    assert "yes" not in schema["properties"]  # the Run form has no toggle that skips the approval
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert gpu.work_pool_name == "kiln-gpu" and gpu_pool.concurrency_limit == 1
    assert Path(release.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"]) == REPO


@pytest.mark.parametrize("param, needle", [
    ("channel=beta", "beta"),
    ("version=1.0", "is not of type 'string'"),  # why the deploy guide quotes the version
])
def test_server_refuses_release_parameters_outside_the_schema(deployed, param, needle):
    proc = deployed.cli("deployment", "run", "release/release", "--param", "version=1.0.0", "--param", param,
                        check=False)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr


def test_the_deployment_cannot_be_told_to_skip_the_approval(deployed):
    proc = deployed.cli("deployment", "run", "release/release", "--param", 'version="9.9.9"', "--param", "yes=true",
                        check=False)
    assert proc.returncode != 0, proc.stdout
    assert "yes" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def triggered(deployed, webhook, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """The guide's release commands on a committed tiny project, and a failing nightly, started at once.

    The release deployment takes one run at a time: the real release waits until the dry run is approved.
    """
    base = tmp_path_factory.mktemp("release")
    config = git_project("tiny", base)
    dry, real = [w for w in readme_commands() if w[:3] == ["prefect", "deployment", "run"]]
    assert "dry_run=true" in dry and "dry_run=true" not in real
    runs = {"dry": (_deployment_run(deployed, dry, config_path=str(config), out=str(base / "out")), base / "out")}
    if BROKEN.exists():
        out = tmp_path_factory.mktemp("nightly") / "out"
        runs["nightly"] = (_deployment_run(deployed, ["prefect", "deployment", "run", "nightly/nightly"],
                                           config_path=str(BROKEN), out=str(out)), out)
    runs["real"] = (_deployment_run(deployed, real, config_path=str(config), out=str(base / "out")), base / "out")
    return runs


def _paused(server: PrefectServer, run_id: str, deadline_s: float):
    """The flow run once it is paused for approval, and the description its approver reads."""
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.settings import PREFECT_API_URL, temporary_settings

    end = time.monotonic() + deadline_s
    with server.client() as client:
        while time.monotonic() < end:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_paused():
                with temporary_settings({PREFECT_API_URL: server.api_url}):
                    description = read_flow_run_input(keyset_from_paused_state(run.state)["description"],
                                                      flow_run_id=run.id)
                return run, description
            assert run.state is None or not run.state.is_final(), f"ended {run.state.name}: {run.state.message}"
            time.sleep(2)
    pytest.fail(f"flow run {run_id} did not pause for approval within {deadline_s} s")


def _approve(server: PrefectServer, run_id, comment: str) -> None:
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}):
        resume_flow_run(run_id, run_input={"approve": True, "comment": comment})


def _summary(server: PrefectServer, run) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with server.client() as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    found = [a.data for a in artifacts if a.key == "kiln-release-summary"]
    assert found, [a.key for a in artifacts]
    return found[0]


def test_the_readme_dry_run_pauses_with_its_plan_and_completes_once_approved(deployed, triggered):
    run_id, out = triggered["dry"]
    run, description = _paused(deployed, run_id, deadline_s=900)
    assert "Approve release `0.2.0` to the `release` channel?" in description
    assert "- dry run: yes" in description and "(release, dry run)" in description
    assert "- to add: " in description and "tiny_kernels-0.2.0+cpu" in description
    assert "pages would change" in description
    _approve(deployed, run.id, "dry run looks right")
    run = deployed.wait_final(run.id, deadline_s=600)
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.state.message == "release 0.2.0 published to release (dry run)"
    summary = _summary(deployed, run)
    assert "approved in the UI: dry run looks right" in summary and "benchmarks: " in summary
    assert not (out / "index").exists()  # a dry run writes only its staging copy


def test_the_readme_release_publishes_and_verifies_once_approved(deployed, triggered):
    run_id, out = triggered["real"]
    run, description = _paused(deployed, run_id, deadline_s=1500)  # waits for the dry run first
    assert "- dry run: no" in description and "(release, preview)" in description and "- to add: " in description
    assert not (out / "index").exists()  # nothing is published before the approval
    _approve(deployed, run.id, "perf reviewed by the kernel team")
    run = deployed.wait_final(run.id, deadline_s=600)
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.state.message == "release 0.2.0 published to release"
    summary = _summary(deployed, run)
    assert "approved in the UI: perf reviewed by the kernel team" in summary and "verify: COMPLETED" in summary
    # the per-variant indexes (the combined PEP 825 index, release/wheel-variants/, holds public-version wheels)
    wheels = sorted(p.name for p in (out / "index" / "release").rglob("*.whl") if "wheel-variants" not in p.parts)
    ours = [w for w in wheels if w.startswith("tiny_kernels-")]
    assert ours and all("0.2.0+" in w for w in ours)
    # tinyk imports kiln.runtime: its wheel sits beside the kernels' in every variant's index
    assert set(wheels) - set(ours) == {"kiln_runtime-0.1.0-py3-none-any.whl"}


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture(scope="module")
def webhook(deployed):
    """A loopback webhook receiver and the automation applied with the Prefect CLI."""
    hook = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    from prefect.blocks.webhook import Webhook
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = f"kiln-alerts-{uuid.uuid4().hex[:6]}"
    with temporary_settings({PREFECT_API_URL: deployed.api_url}):
        Webhook(url=f"http://127.0.0.1:{hook.server_port}/", method="POST").save(name)
        block_id = str(Webhook.load(name)._block_document_id)
    text = (REPO / "automations" / "notify-on-failure.yaml").read_text()
    applied = deployed.logs / "automation.yaml"
    applied.write_text(os.path.expandvars(text.replace("${KILN_WEBHOOK_BLOCK_ID}", block_id)))
    deployed.cli("automation", "create", "--from-file", str(applied))
    yield _Hook.received
    hook.shutdown()


@pytest.mark.skipif(not BROKEN.exists(), reason="the build stage's broken fixture project has not landed")
def test_nightly_with_a_failing_build_unit(deployed, webhook, triggered):
    run_id, out = triggered["nightly"]
    run = deployed.wait_final(run_id, deadline_s=900)
    assert run.state.type.value == "FAILED"
    manifest = json.loads((out / "latest" / "run.json").read_text())
    failed = [u for u in manifest["units"] if u["state"] == "failed"]
    assert failed and all(u["id"] in run.state.message or u["variant"] in run.state.message for u in failed[:1])
    failed_variants = {u["variant"] for u in failed if u["stage"] == "build"}
    others = [u for u in manifest["units"] if u["stage"] == "build" and u["variant"] not in failed_variants]
    assert others and all(u["state"] == "completed" for u in others)
    for variant in failed_variants:
        assert not (out / "index" / "nightly" / variant).exists(), f"failed variant {variant} was published"
    # The automation posts to the webhook when the nightly fails (bounded wait).
    end = time.monotonic() + 300
    while time.monotonic() < end and not any(str(run.id) == h.get("id") for h in webhook):
        time.sleep(1)
    assert any(str(run.id) == h.get("id") and h.get("flow") == "nightly" for h in webhook), webhook
