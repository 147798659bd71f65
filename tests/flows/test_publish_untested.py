"""Every published variant says what tested it; kiln.toml can hold an untested one back; no wheel to bench is "not run"."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.core.manifest import RunManifest, Unit
from kiln.core.store import LocalStore
from kiln.flows.report.summary import render_text
from kiln.release.publish.plan import Plan
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.tasks.bench.harness import nothing_to_bench
from kiln.tasks.project.config import Publish
from kiln.tasks.releasing import held_untested, publish_facts, untested_ok, variants_to_publish, without_suite
from tests.helpers.wheelkit import make_wheel


def config(publish_untested: bool = True, suites: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(
        variants=[SimpleNamespace(name="cu130"), SimpleNamespace(name="cpu")], suites=list(suites),
        project=SimpleNamespace(distribution="demo"),
        publish=SimpleNamespace(publish_untested=publish_untested, extra_index_urls=()))


def built(tmp_path: Path, *units: Unit) -> RunManifest:
    run = RunManifest(tmp_path, "r1", flow="nightly", version="1.0.dev1")
    for variant in ("cu130", "cpu"):
        run.add_artifact(make_wheel(tmp_path / "wheels" / variant, "demo", f"1.0.dev1+{variant}"), step="build",
                         kind="wheel", variant=variant)
    for unit in units:
        run.add_unit(unit)
    return run


GPU_SUITE_RAN = Unit("test/kernels-gpu/cu130", "test", "completed", variant="cu130", suite="kernels-gpu")


def test_a_variant_no_suite_covers_is_named(tmp_path):
    run = built(tmp_path, GPU_SUITE_RAN)
    assert without_suite(run, ["cu130", "cpu"]) == {"cpu": "no suite covers cpu"}


def test_a_suite_of_every_variant_covers_each_and_one_that_did_not_run_is_named(tmp_path):
    assert without_suite(built(tmp_path / "a", Unit("test/all", "test", "flaky", suite="all")), ["cpu"]) == {}
    optional = Unit("test/extra/cpu", "test", "not_run", variant="cpu", suite="extra", required=False,
                    message="not run: needs 1 GPU, 0 on this machine")
    assert without_suite(built(tmp_path / "b", optional), ["cpu"]) == {
        "cpu": "no suite ran on cpu (extra: not run: needs 1 GPU, 0 on this machine)"}


def test_publish_untested_false_holds_back_only_built_variants_no_suite_ran_on(tmp_path):
    run = built(tmp_path, GPU_SUITE_RAN)
    assert held_untested(config(True), run) == {}
    assert variants_to_publish(config(False), run) == (["cu130"], {
        "cpu": "not published: no suite covers cpu, and kiln.toml [publish] publish_untested = false holds it back"})
    suites = [SimpleNamespace(name="kernels-gpu", publish_untested=True)]
    assert untested_ok(config(True, suites)) == ["kernels-gpu"] and untested_ok(config(False, suites)) == []


def test_the_setting_is_read_from_kiln_toml_publish_and_defaults_to_publishing_with_the_mark():
    targets = {"local": {"url": "file://.kiln/index"}}
    assert Publish.model_validate({"targets": targets}).publish_untested is True
    assert Publish.model_validate({"targets": targets, "publish_untested": False}).publish_untested is False


def _published(tmp_path: Path, run: RunManifest, untested_ok: tuple[str, ...] = ()) -> Plan:
    return publish(run, LocalStore(tmp_path / "index"),
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"],
                                  untested_ok=untested_ok))


def test_a_published_variant_no_suite_ran_on_is_in_the_summarys_first_lines(tmp_path):
    run = built(tmp_path / "run", GPU_SUITE_RAN)
    facts = publish_facts(config(), run, _published(tmp_path, run), env={"KILN_CHECK_EXTRA_INDEXES": "off"})
    assert facts["published_untested"] == {} and facts["published_without_suite"] == {"cpu": "no suite covers cpu"}
    run.info.update(facts)
    assert render_text(run).splitlines()[1] == "PUBLISHED UNTESTED: no suite covers cpu"


def test_a_required_suite_not_run_keeps_its_own_line_and_is_not_named_twice(tmp_path):
    gpu = Unit("test/kernels-gpu/cu130", "test", "not_run", variant="cu130", suite="kernels-gpu",
               message="not run: needs 1 GPU, 0 on this machine")
    cpu = Unit("test/kernels/cpu", "test", "completed", variant="cpu", suite="kernels")
    run = built(tmp_path / "run", gpu, cpu)
    plan = _published(tmp_path, run, untested_ok=("kernels-gpu",))  # the suite's publish_untested = true
    facts = publish_facts(config(), run, plan, env={"KILN_CHECK_EXTRA_INDEXES": "off"})
    assert facts["published_untested"] == {"cu130": "kernels-gpu: needs 1 GPU, 0 on this machine"}
    assert facts["published_without_suite"] == {}


@pytest.mark.parametrize(("units", "wheel", "expected"), [
    ((), True, ""),
    ((Unit("build/cpu/-/demo/pep517", "build", "failed", variant="cpu"),), False,
     "not run: run r9 has no cpu wheel to benchmark: its build failed (build/cpu/-/demo/pep517)"),
    ((), False, "not run: run r9 has no cpu wheel to benchmark: the run built no cpu wheel "
                "(its build did not run, or built nothing for it)"),
])
def test_a_variant_with_nothing_to_benchmark_is_not_run_with_the_reason(tmp_path, units, wheel, expected):
    run = built(tmp_path) if wheel else RunManifest(tmp_path, "r9")
    assert nothing_to_bench("r9", "cpu", units, run.artifacts) == expected
