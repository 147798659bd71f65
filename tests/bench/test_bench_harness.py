"""The harness on the CPU, for real (torch.utils.benchmark), on a tiny torch-only project."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.core.errors import BenchmarkError, ConfigError, InfrastructureError
from kiln.tasks.bench.harness import MetricPlan, bench_kernel, bench_specs, prepare, resolve_metric
from kiln.tasks.project.config import load_config
from tests.helpers.benchfakes import CPU_PLAN


def test_auto_is_cpu_without_a_gpu_and_graph_replay_with_one():
    assert resolve_metric("auto", cuda_available=False) == MetricPlan("cpu", "cpu", ("cpu",))
    assert resolve_metric("auto", cuda_available=True) == MetricPlan("cuda", "graph_replay", ("graph_replay", "eager"))
    assert resolve_metric("eager", cuda_available=True) == MetricPlan("cuda", "eager", ("eager",))
    assert resolve_metric("cpu", cuda_available=True) == MetricPlan("cpu", "cpu", ("cpu",))


@pytest.mark.parametrize(("metric", "message"), [("graph_replay", "needs a CUDA"), ("eager", "needs a CUDA"),
                                                 ("wallclock", "not one of")])
def test_a_metric_this_machine_cannot_measure_is_refused(metric, message):
    with pytest.raises(ConfigError, match=message):
        resolve_metric(metric, cuda_available=False)


def test_prepare_takes_the_size_from_kiln_toml_and_refuses_unknown_sizes(benchproj: Path):
    config = load_config(benchproj)
    setup = prepare(config, None, "cpu")
    assert setup.size == "small" and setup.kernels == ("axpy", "rownorm", "nobench")
    with pytest.raises(ConfigError, match="'huge'"):
        prepare(config, "huge", "cpu")


def test_unknown_kernels_are_refused_by_name(benchproj: Path):
    with pytest.raises(ConfigError, match="'nope'"):
        bench_specs(load_config(benchproj), ["nope"])


def test_a_real_cpu_run_measures_kernel_and_reference_in_interleaved_blocks(benchproj: Path):
    (spec,) = bench_specs(load_config(benchproj), ["rownorm"])
    results = bench_kernel(spec, "small", CPU_PLAN)
    assert [(r.kernel, r.name, r.metric) for r in results] == [
        ("rownorm", "m8_n128", "cpu"), ("rownorm", "m16_n256", "cpu")]
    for result in results:
        assert len(result.stats.samples) == len(result.reference.samples) == 20  # one pair per block
        assert result.stats.ci_low <= result.stats.median <= result.stats.ci_high
        assert 1e-7 < result.stats.median < 1e-2 and result.gbps > 0


def _case(fn, name="c1"):
    return SimpleNamespace(kernel="k", name=name, shape={"N": 4}, dtype="float32", make_inputs=lambda d: (),
                           fn=fn, reference=fn, bytes=0, flops=0)


def _spec(*cases):
    return SimpleNamespace(name="k", bench_cases=lambda size: list(cases))


def test_a_case_that_raises_fails_with_its_name_and_cause():
    def broken():
        raise RuntimeError("kaput")

    with pytest.raises(BenchmarkError, match=r"k/c2 failed: RuntimeError: kaput") as info:
        bench_kernel(_spec(_case(lambda: None), _case(broken, "c2")), "small", CPU_PLAN)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_running_out_of_device_memory_is_retryable():
    class OutOfMemoryError(RuntimeError):  # fault injection: the name torch.cuda uses
        pass

    def oom():
        raise OutOfMemoryError("CUDA out of memory")

    with pytest.raises(InfrastructureError, match="out of device memory") as info:
        bench_kernel(_spec(_case(oom)), "small", CPU_PLAN)
    assert info.value.retryable


def test_bench_cases_that_raise_become_a_config_error_naming_the_kernel():
    spec = SimpleNamespace(name="k", bench_cases=lambda size: 1 / 0)
    with pytest.raises(ConfigError, match=r"kernel 'k': bench_cases\('small'\) raised ZeroDivisionError"):
        bench_kernel(spec, "small", CPU_PLAN)


@pytest.mark.parametrize(("change", "needle"), [
    ({"shape": [4]}, "kernel 'k': bench_cases('small'), case 'c1': field 'shape' must map dimension names to sizes, got list"),
    ({"kernel": "other"}, "case 'c1': field 'kernel' is 'other', but the case is listed by kernel 'k'"),
    ({"bytes": -1}, "case 'c1': field 'bytes' must be a non-negative int, got -1"),
    ({"reference": None}, "case 'c1': field 'reference' must be callable, got NoneType"),
])
def test_a_malformed_case_is_a_config_error_before_anything_is_timed(change, needle):
    case = _case(lambda: None)
    for key, value in change.items():
        setattr(case, key, value)
    with pytest.raises(ConfigError) as info:
        bench_kernel(_spec(case), "small", CPU_PLAN, timers={"cpu": _never_called})
    assert needle in str(info.value)


def _never_called(*_):
    raise AssertionError("a malformed case must be refused before it is timed")
