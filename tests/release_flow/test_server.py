"""Prefect operations against a real server: deploy, worker, deployment runs.

Creates the work pool, runs ``prefect deploy --all`` from this checkout,
starts a process worker, then triggers the ``release`` deployment with
``prefect deployment run`` and a nightly whose build is made to fail, and
reads the results back through the Prefect API client.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from .conftest import POOL, REPO, PrefectServer

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "fixtures" / "projects" / "tiny" / "kiln.toml"
BROKEN = REPO / "tests" / "fixtures" / "projects" / "broken" / "kiln.toml"
RUN_ID = re.compile(r"UUID:\s*([0-9a-f-]{36})")


@pytest.fixture(scope="module")
def deployed(real_server: PrefectServer) -> PrefectServer:
    """Work pools through the API client, ``prefect deploy --all``, one process worker."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with real_server.client() as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process", base_job_template=template))
        # A GPU pool runs one job per node at a time: the pool's concurrency limit.
        client.create_work_pool(WorkPoolCreate(name="kiln-gpu", type="process", base_job_template=template,
                                               concurrency_limit=1))
    real_server.cli("deploy", "--all", timeout=180)
    real_server.start("worker", "worker", "start", "--pool", POOL, "--limit", "2")
    return real_server


def _run(server: PrefectServer, deployment: str, **params) -> str:
    args = [arg for name, value in params.items() for arg in ("--param", f"{name}={value}")]
    proc = server.cli("deployment", "run", deployment, *args)
    match = RUN_ID.search(proc.stdout)
    assert match, proc.stdout
    return match.group(1)


def test_deployments_carry_schedule_schema_and_limits(deployed, triggered):
    # ``triggered`` only starts the runs early; the tests below wait for them.
    with deployed.client() as client:
        gpu_pool = client.read_work_pool("kiln-gpu")
        release = client.read_deployment_by_name("release/release")
        nightly = client.read_deployment_by_name("nightly/nightly")
        gpu = client.read_deployment_by_name("test/gpu-tests-kiln-gpu")
    assert release.enforce_parameter_schema
    assert release.global_concurrency_limit is not None and release.global_concurrency_limit.limit == 1
    assert release.parameter_openapi_schema["properties"]["channel"]["enum"] == ["release", "nightly"]
    assert release.parameter_openapi_schema["required"] == ["version"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert gpu.work_pool_name == "kiln-gpu" and gpu_pool.concurrency_limit == 1
    assert Path(release.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"]) == REPO


def test_server_refuses_release_parameters_outside_the_schema(deployed):
    proc = deployed.cli("deployment", "run", "release/release", "--param", "version=1.0.0",
                        "--param", "channel=beta", check=False)
    assert proc.returncode != 0
    assert "beta" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def triggered(deployed, webhook, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Both deployment runs started at once (the worker takes two), so they overlap."""
    runs = {"release": tmp_path_factory.mktemp("release") / "out"}
    runs["release"] = (_run(deployed, "release/release", version="0.1.0", yes="true", dry_run="true",
                            config_path=str(TINY), out=str(runs["release"])), runs["release"])
    if BROKEN.exists():
        out = tmp_path_factory.mktemp("nightly") / "out"
        runs["nightly"] = (_run(deployed, "nightly/nightly", config_path=str(BROKEN), out=str(out)), out)
    return runs


def test_release_deployment_dry_run(deployed, triggered):
    run_id, out = triggered["release"]
    run = deployed.wait_final(run_id, deadline_s=300)
    assert run.state.type.value == "COMPLETED", run.state.message
    assert "(dry run)" in run.state.message
    with deployed.client() as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    summary = [a for a in artifacts if a.key == "kiln-release-summary"]
    assert summary and "approved on the command line" in summary[0].data
    assert not (out / "index").exists()  # a dry run writes only its staging copy


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
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
    run = deployed.wait_final(run_id, deadline_s=300)
    assert run.state.type.value == "FAILED"
    manifest = json.loads((out / "run.json").read_text())
    failed = [u for u in manifest["units"] if u["state"] == "failed"]
    assert failed and all(u["id"] in run.state.message or u["variant"] in run.state.message for u in failed[:1])
    failed_variants = {u["variant"] for u in failed if u["stage"] == "build"}
    others = [u for u in manifest["units"] if u["stage"] == "build" and u["variant"] not in failed_variants]
    assert others and all(u["state"] == "completed" for u in others)
    for variant in failed_variants:
        assert not (out / "index" / "nightly" / variant).exists(), f"failed variant {variant} was published"
    # The automation posts to the webhook when the nightly fails (bounded wait).
    end = time.monotonic() + 60
    while time.monotonic() < end and not any(str(run.id) == h.get("id") for h in webhook):
        time.sleep(1)
    assert any(str(run.id) == h.get("id") and h.get("flow") == "nightly" for h in webhook), webhook
