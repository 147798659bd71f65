"""A registry whose kernels declare no bench cases: the bench stage makes no environment and starts no measuring
server, and says why; what it knows comes from a read of the registry in its guest (the build's, or its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.build import plancache
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.project import registry_guest
from kiln.tasks.project.config import load_config
from tests.helpers.projects import copy_project
from tests.helpers.runkit import make_record

NO_CASES = "not run: no kernel declares bench cases (the registry 'nosy.registry:registry')"
CPU_VARIANT = '\n[[variants]]\nname = "cpu"\nbackend = "cpu"\n'


@pytest.fixture
def reads(monkeypatch) -> list[object]:
    """Every read of the registry (each a real guest), counted."""
    calls: list[object] = []
    real = registry_guest.load_registry_data

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_guest, "load_registry_data", counting)
    return calls


def _declare_cases(config: Path) -> None:
    registry = config.parent / "nosy" / "registry.py"
    registry.write_text(registry.read_text().replace("description=json.dumps",
                                                     "bench_cases=lambda size: [], description=json.dumps"))


def test_no_kernel_with_bench_cases_is_a_reason_not_to_measure_read_once(tmp_path, reads):
    from kiln.tasks.bench.harness import no_bench_cases

    config = load_config(copy_project("nosy", tmp_path))
    assert no_bench_cases(config).startswith(NO_CASES)
    assert no_bench_cases(config).startswith(NO_CASES)
    assert len(reads) == 1  # the first read is recorded; the second answer comes from that record


def test_a_kernel_with_bench_cases_measures_as_always_even_after_a_record_of_none(tmp_path, reads):
    from kiln.tasks.bench.harness import no_bench_cases

    path = copy_project("nosy", tmp_path)
    assert no_bench_cases(load_config(path)).startswith(NO_CASES)
    _declare_cases(path)  # the package changed: the record no longer holds
    assert no_bench_cases(load_config(path)) == ""
    assert len(reads) == 2


def test_the_builds_read_of_the_registry_is_what_the_bench_stage_uses(tmp_path, reads):
    from kiln.tasks.bench.harness import no_bench_cases

    path = copy_project("nosy", tmp_path)
    _declare_cases(path)
    config = load_config(path)
    prepare_build(config, "0.1.0", None)
    assert plancache.bench_kernels(config.path(config.build.cache_dir), config) == ("copy",)
    assert no_bench_cases(config) == ""
    assert reads == []  # the build read it through kiln.tasks.build.stage's own name: none here


@pytest.mark.slow
def test_the_bench_stage_of_a_package_without_cases_makes_no_environment_and_says_why(prefect_server, tmp_path):
    from kiln.flows.bench import bench_flow

    path = copy_project("nosy", tmp_path)
    path.write_text(path.read_text() + CPU_VARIANT)  # a variant this machine measures
    out = tmp_path / "run"
    run = make_record(path, out, {"cpu": [("nosy_kernels", "0.1.0")]})
    state = bench_flow(config_path=str(path), out=str(out), run_id=run.run_id, store_history=False,
                       return_state=True)
    assert state.is_completed(), state.message
    unit = {u.id: u for u in RunManifest.load(run.view).units}["bench/cpu"]
    assert unit.state == "not_run" and unit.message.startswith(NO_CASES), unit.message
    assert not (run.view / "bench" / ".env").exists()
