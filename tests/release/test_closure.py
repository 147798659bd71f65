"""Dependency closure before publishing: pip's resolver, on the index as staged plus the real dependency indexes.

Every index here is local (the staged one and a ``file://`` dependency index built with ``kiln index``), so
pip really resolves, offline.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kiln.core.errors import InfrastructureError
from kiln.core.manifest import RunManifest, Unit
from kiln.core.store import LocalStore
from kiln.core.wheels import read_wheel
from kiln.flows.publish import publish_flow
from kiln.flows.report.hint import first_lines
from kiln.release.cli import index_command
from kiln.release.publish.closure import ClosureQuery, Staged, read_refusal, resolve_all
from kiln.release.publish.protocol import DependencyCheck, PublishRequest, PublishSteps, publish
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

from .test_publish_flow import KILN_TOML

ABSENT = "kiln-test-absent-dependency>=1.0"


def _run(root: Path, requires: dict[str, list[str]]) -> RunManifest:
    """A saved run with a ``demo`` wheel per variant requiring ``requires[variant]``."""
    run = RunManifest(root=root, run_id=uuid.uuid4().hex, flow="test")
    for variant, needs in requires.items():
        path = make_wheel(root / "wheels" / variant, "demo", f"1.0.dev1+{variant}", requires=needs)
        run.add_artifact(path, step="build", kind="wheel", variant=variant)
    run.save()
    return run


def _dependency_index(tmp: Path) -> str:
    """A file:// index holding ``helper 2.0``, as PyPI or a mirror would hold a dependency."""
    make_wheel(tmp / "dep-wheels", "helper", "2.0")
    assert index_command(str(tmp / "dep-wheels"), None, str(tmp / "deps")) == 0
    return (tmp / "deps").as_uri() + "/"


def _publish(run: RunManifest, store: LocalStore, variants: list[str], indexes: list[str], extra=()):
    return publish(run, store,
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=variants, extra=extra),
                   PublishSteps(clock=lambda: 1e9, dependencies=DependencyCheck(resolve_all, indexes=indexes)))


def test_a_wheel_whose_dependency_no_index_has_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    plan = _publish(_run(tmp_path / "run", {"cpu": [ABSENT]}), store, ["cpu"], [_dependency_index(tmp_path)])
    assert "kiln-test-absent-dependency>=1.0" in plan.skipped["cpu"], plan.skipped
    assert "demo==1.0.dev1+cpu would not install" in plan.skipped["cpu"]
    assert plan.uploads == [] and plan.pages == [] and store.list("") == []


def test_only_the_variant_that_does_not_resolve_is_held_back(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    run = _run(tmp_path / "run", {"cpu": ["helper==2.0"], "cu130": [ABSENT]})
    plan = _publish(run, store, ["cpu", "cu130"], [_dependency_index(tmp_path)])
    assert list(plan.skipped) == ["cu130"] and plan.keys("added") == [
        "nightly/cpu/simple/demo/demo-1.0.dev1+cpu-py3-none-any.whl"]
    assert store.list("nightly/cu130") == []


def test_a_dependency_published_beside_the_wheel_resolves_from_the_staged_index(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "index")
    pin = make_wheel(tmp_path / "pins", "helper", "2.0")
    plan = _publish(_run(tmp_path / "run", {"cpu": ["helper==2.0"]}), store, ["cpu"], [], extra=[(None, pin)])
    assert plan.skipped == {} and len(plan.keys("added")) == 2
    unpinned = _publish(_run(tmp_path / "run2", {"cpu": ["helper==2.0"]}), LocalStore(tmp_path / "i2"), ["cpu"], [])
    assert "helper==2.0" in unpinned.skipped["cpu"]  # without the pin or an index that has it: refused


def test_the_cache_key_names_the_requirements_not_the_version(tmp_path: Path) -> None:
    def query(version: str, needs: list[str]) -> ClosureQuery:
        path = make_wheel(tmp_path / version / "-".join(needs), "demo", version, requires=needs)
        return ClosureQuery("cpu", Staged(read_wheel(path)[0], path), (), ("https://pypi.org/simple",))

    assert query("1.0.dev1", ["numpy"]).cache_key == query("1.0.dev2", ["numpy"]).cache_key
    assert query("1.0.dev1", ["numpy"]).cache_key != query("1.0.dev1", ["numpy<2"]).cache_key


@pytest.mark.slow
def test_the_publish_flow_records_the_check_reuses_an_identical_answer_and_holds_back_aread_refusal(
        prefect_server, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    (tmp_path / "src").mkdir()
    config = tmp_path / "kiln.toml"
    deps = _dependency_index(tmp_path)
    line = 'channels = { nightly = "nightly", release = "release" }'
    text = KILN_TOML.format(bucket=s3_bucket, endpoint=s3_endpoint)
    config.write_text(text.replace(line, f'{line}\nextra_index_urls = ["{deps}"]'))

    def nightly(n: int, requires: list[str]) -> tuple[bool, dict[str, Unit]]:
        out = tmp_path / f"out{n}"
        run = make_record(config, out, {"cpu": [("demo", f"1.0.dev{n}+cpu")]}, requires=requires)
        state = publish_flow(config_path=str(config), out=str(out), run_id=run.run_id, return_state=True)
        return state.is_completed(), {u.id: u for u in RunManifest.load(run.view).units if u.stage == "publish"}

    ok, units = nightly(1, ["helper==2.0"])
    check = units["publish/dependencies/cpu"]
    assert ok and check.state == "completed" and "demo==1.0.dev1+cpu resolves" in check.message, check
    assert "answered by an identical check" not in check.message
    ok, units = nightly(2, ["helper==2.0"])  # the next nightly asks the same question
    assert ok and "answered by an identical check" in units["publish/dependencies/cpu"].message
    ok, units = nightly(3, [ABSENT])
    assert not ok and units["publish/dependencies/cpu"].state == "failed"
    assert units["publish/cpu"].state == "skipped" and ABSENT in units["publish/cpu"].message
    listed = LocalStore(tmp_path / "out3" / "index").get("nightly/cpu/simple/demo/index.json") or b""
    assert b"1.0.dev3" not in listed


def test_conflicting_pins_are_named_and_warn_publishes_the_variant_marked(tmp_path: Path) -> None:
    make_wheel(tmp_path / "dep-wheels", "helper", "1.0")
    make_wheel(tmp_path / "dep-wheels", "helper", "2.0")
    make_wheel(tmp_path / "dep-wheels", "other", "1.0", requires=["helper==1.0"])
    assert index_command(str(tmp_path / "dep-wheels"), None, str(tmp_path / "deps")) == 0
    deps = [(tmp_path / "deps").as_uri() + "/"]
    run = _run(tmp_path / "run", {"cpu": ["helper==2.0", "other"]})
    refused = _publish(run, LocalStore(tmp_path / "a"), ["cpu"], deps)
    why = refused.skipped["cpu"]
    assert "conflicting pins:" in why and "depends on helper==2.0" in why and "other 1.0 depends on helper==1.0" in why
    store = LocalStore(tmp_path / "b")
    warned = publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]),
                     PublishSteps(clock=lambda: 1e9,
                                  dependencies=DependencyCheck(resolve_all, indexes=deps, refuses=False)))
    assert warned.skipped == {} and list(warned.uninstallable) == ["cpu"] and warned.keys("added")
    assert "published although it will not install" in warned.to_markdown()
    assert first_lines({"published_uninstallable": warned.uninstallable})[0].startswith(
        "PUBLISHED, WILL NOT INSTALL: cpu: demo==1.0.dev1+cpu would not install")


def test_a_pip_failure_that_is_no_answer_is_an_infrastructure_error_not_a_verdict(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "demo", "1.0")
    query = ClosureQuery("cpu", Staged(read_wheel(path)[0], path), (), ())
    full_disk = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    with pytest.raises(InfrastructureError, match="No space left on device"):
        read_refusal(query, full_disk)
    missing = "ERROR: No matching distribution found for torch==9.9\n"
    assert read_refusal(query, missing).missing == "torch==9.9"
