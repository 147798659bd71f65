"""Flow runs are named for what they build, in the Prefect API: never Prefect's random words."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client

from kiln.flows.report.runname import release_name
from tests.helpers.gitrepo import git, git_project


@pytest.mark.parametrize("parameters, name", [
    ({"version": "0.2.0"}, "release 0.2.0"),
    ({"version": "0.2.0", "channel": "release", "dry_run": True}, "release 0.2.0 (dry run)"),
    ({"version": "0.2.0rc1", "channel": "nightly"}, "release 0.2.0rc1 → nightly"),
])
def test_a_release_is_named_by_its_version_before_it_runs(parameters, name):
    assert release_name(parameters) == name


def _name_of(state) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).name


def test_the_release_flows_take_their_name_from_their_parameters_in_the_api(prefect_server):
    from prefect import flow

    from kiln.flows.release import approved_release_flow, release_flow

    assert release_flow.flow_run_name is approved_release_flow.flow_run_name

    @flow(name="release-name-probe", flow_run_name=release_flow.flow_run_name)
    def probe(version: str, channel: str = "release", dry_run: bool = False) -> None:
        """The release flows' naming on a flow that does nothing else (a release takes minutes)."""

    assert _name_of(probe("0.2.0", dry_run=True, return_state=True)) == "release 0.2.0 (dry run)"


@pytest.mark.slow
def test_a_build_and_its_publish_are_named_by_variant_version_and_commit_in_the_api(prefect_server, tmp_path):
    from kiln.flows.build import build_flow
    from kiln.flows.publish import publish_flow

    config = git_project("tiny", tmp_path)
    sha12 = git(config.parent, "rev-parse", "HEAD")[:12]
    out = tmp_path / "out"
    built = build_flow(str(config), str(out), version="0.1.0.dev20261130210703", variants=["cpu"], return_state=True)
    assert built.is_completed(), built.message
    assert _name_of(built) == f"build cpu @ {sha12}"
    run_id = str(built.state_details.flow_run_id)
    published = publish_flow(str(config), str(out), dry_run=True, run_id=run_id, return_state=True)
    assert _name_of(published) == f"publish nightly 0.1.0.dev20261130210703 (dry run) @ {sha12}"


def test_a_nightly_is_named_by_version_and_commit_before_it_runs(prefect_server, tmp_path):
    from prefect import flow

    from kiln.flows.nightly import nightly_flow
    from kiln.flows.report.runname import nightly_name
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.versioning import nightly_version

    config = git_project("tiny", tmp_path)
    sha12 = git(config.parent, "rev-parse", "HEAD")[:12]
    when = int(git(config.parent, "log", "-1", "--format=%ct"))
    expected = f"nightly {nightly_version(load_config(config).project.version, when)} @ {sha12}"
    assert nightly_name({"config_path": str(config)}) == expected
    assert nightly_name({"config_path": str(tmp_path / "missing.toml")}) == "nightly"  # never a failed start

    @flow(name="nightly-name-probe", flow_run_name=nightly_flow.flow_run_name)
    def probe(config_path: str = "kiln.toml") -> None:
        """The nightly's naming on a flow that does nothing else: the name the API has from its first instant."""

    assert _name_of(probe(str(config), return_state=True)) == expected


def test_every_step_is_named_by_its_parameters_and_commit_before_it_runs(prefect_server, tmp_path):
    from prefect import flow

    from kiln.flows.bench import bench_flow
    from kiln.flows.build import build_flow
    from kiln.flows.publish import publish_flow
    from kiln.flows.report.runname import step_name
    from kiln.flows.test import test_flow
    from kiln.tasks.project.config import load_config
    from kiln.tasks.run.versioning import nightly_version

    config = git_project("tiny", tmp_path)
    sha12 = git(config.parent, "rev-parse", "HEAD")[:12]
    version = nightly_version(load_config(config).project.version, int(git(config.parent, "log", "-1", "--format=%ct")))
    where = {"config_path": str(config)}
    assert step_name("build", {**where, "variants": ["cpu", "cu130"]}) == f"build cpu, cu130 @ {sha12}"
    assert step_name("build", where) == f"build every variant @ {sha12}"
    assert step_name("test", {**where, "suites": ["unit"]}) == f"test unit @ {sha12}"
    assert step_name("test", {**where, "paths": ["tests/a.py"]}) == f"test tests/a.py @ {sha12}"
    assert step_name("bench", where) == f"bench {version} @ {sha12}"
    assert step_name("publish", {**where, "dry_run": True}) == f"publish nightly (dry run) @ {sha12}"
    assert step_name("build", {"config_path": str(tmp_path / "missing.toml")}) == "build every variant"  # never a failed start
    for step in (build_flow, test_flow, bench_flow, publish_flow):
        @flow(name=f"{step.name}-name-probe", flow_run_name=step.flow_run_name)
        def probe(config_path: str = "kiln.toml", variants: list[str] | None = None) -> None:
            """The step's naming on a flow that does nothing else: the name the API has from its first instant."""

        named = _name_of(probe(str(config), ["cpu"], return_state=True))
        assert named.startswith(f"{step.name} ") and named.endswith(f" @ {sha12}"), named
