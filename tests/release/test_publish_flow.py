"""publish_flow under the session's Prefect server: one task run per upload, units, final state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.core.manifest import RunManifest, Unit
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.flows.publish import publish_flow
from kiln.flows.report.summary import render_text
from tests.helpers.pageparse import parse_json
from tests.helpers.runkit import make_record

from .test_publish_local import assert_index_consistent

KILN_TOML = """
[project]
package = "demo"
distribution = "demo"
version = "1.0"
source = "src"
registry = "demo.registry:registry"

[[variants]]
name = "cu130"
backend = "cuda"
archs = ["9.0"]

[[variants]]
name = "cpu"
backend = "cpu"
archs = []

[publish]
default_target = "local"
channels = {{ nightly = "nightly", release = "release" }}

[publish.targets.local]
url = "file://{{out}}/index"

[publish.targets.s3]
url = "s3://{bucket}/simple"
region = "us-east-1"
endpoint = "{endpoint}"

[permissions.publish-nightly]
read = ["nightly/"]
write = ["nightly/"]
credentials = {{ ambient = true }}
"""


@pytest.fixture
def config_path(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> str:
    (tmp_path / "src").mkdir()
    path = tmp_path / "kiln.toml"
    path.write_text(KILN_TOML.format(bucket=s3_bucket, endpoint=s3_endpoint))
    return str(path)


@pytest.mark.slow
def test_publish_flow_local_target_publishes_passing_variants_and_records_units(
    prefect_server, tmp_path: Path, config_path: str
) -> None:
    out = tmp_path / "run"
    run = make_record(config_path, out, {"cu130": [("demo", "1.0+cu130")], "cpu": [("demo", "1.0+cpu")]},
                      [Unit("build/cpu/k", "build", "failed", variant="cpu")])
    state = publish_flow(config_path=config_path, out=str(out), run_id=run.run_id, return_state=True)
    assert state.is_completed(), state.message
    store = LocalStore(out / "index")
    assert assert_index_consistent(store, "nightly/cu130/simple") == 1
    assert store.list("nightly/cpu") == []
    units = {u.id: u for u in RunManifest.load(run.view).units if u.stage == "publish"}
    assert units["publish/cu130/demo-1.0+cu130-py3-none-any.whl"].state == "completed"
    assert units["publish/cpu"].state == "skipped" and "build/cpu/k" in units["publish/cpu"].message
    assert units["publish/pages"].state == "completed"
    summary = render_text(RunManifest.load(run.view))  # what `kiln nightly` prints at the end
    index = f"{store.url}/nightly/cu130/simple/"
    install = (f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {index} --no-deps demo==1.0+cu130 && "  # pinned
               f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {index} --extra-index-url https://pypi.org/simple demo==1.0+cu130")
    assert f"index: {index}\n    install: {install}\n" in summary


@pytest.mark.slow
def test_publish_flow_conflicting_wheel_fails_its_unit_and_the_flow_but_publishes_the_rest(
    prefect_server, tmp_path: Path, config_path: str, s3_endpoint: str, s3_session: Any, s3_bucket: str
) -> None:
    first = make_record(config_path, tmp_path / "first", {"cu130": [("demo", "1.0")]}, payload="a")
    assert publish_flow(config_path=config_path, out=str(tmp_path / "first"), target="s3", run_id=first.run_id,
                        return_state=True).is_completed()
    second = make_record(config_path, tmp_path / "second", {"cu130": [("demo", "1.0"), ("other", "2.0")]},
                         payload="b")
    state = publish_flow(config_path=config_path, out=str(tmp_path / "second"), target="s3", run_id=second.run_id,
                         return_state=True)
    assert state.is_failed() and "1 of" in state.message
    units = {u.id: u.state for u in RunManifest.load(second.view).units if u.stage == "publish"}
    assert units["publish/cu130/demo-1.0-py3-none-any.whl"] == "failed"
    assert units["publish/cu130/other-2.0-py3-none-any.whl"] == "completed"
    assert units["publish/pages"] == "completed"
    store = S3Store(make_client(s3_session, "us-east-1", s3_endpoint), s3_bucket, "simple")
    assert assert_index_consistent(store, "nightly/cu130/simple") == 2
    projects = [p["name"] for p in parse_json(store.get("nightly/cu130/simple/index.json"))["projects"]]
    listed = {name: [f["filename"] for f in parse_json(store.get(f"nightly/cu130/simple/{name}/index.json"))["files"]]
              for name in projects}
    assert listed == {"demo": ["demo-1.0-py3-none-any.whl"], "other": ["other-2.0-py3-none-any.whl"]}
    first_bytes = first.fetch(first.artifacts()[0]).read_bytes()
    assert store.get("nightly/cu130/simple/demo/demo-1.0-py3-none-any.whl") == first_bytes


@pytest.mark.slow
def test_publish_flow_dry_run_changes_nothing_on_the_target(prefect_server, tmp_path: Path, config_path: str) -> None:
    out = tmp_path / "run"
    run = make_record(config_path, out, {"cu130": [("demo", "1.0")]})
    state = publish_flow(config_path=config_path, out=str(out), dry_run=True, run_id=run.run_id, return_state=True)
    assert state.is_completed(), state.message
    assert not (out / "index").exists()
    staged = list((run.view / "publish-staging").rglob("demo-1.0-py3-none-any.whl"))
    assert len(staged) == 1
