"""aarch64 cells in the build matrix: ``platform = ["x86_64", "aarch64"]`` expands into one cell per CPU, the
cross path refuses before anything builds what it cannot serve (naming the variant and why), an aarch64 cell's
suites are "not run" on an x86_64 machine, and its wheel's dependencies are checked as an aarch64 machine
would install it."""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import ConfigError
from kiln.core.record import Checkout
from kiln.release.publish.closure import target_python
from kiln.tasks.build.cross import check_cross_cells, cross_refusal, cross_target_of
from kiln.tasks.project.config import KilnConfig, parse_config
from kiln.tasks.project.config_matrix import built_for
from kiln.tasks.testing.emulation import no_runner_reason

KILN_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
_BASE: dict[str, Any] = {
    "project": {"package": "pkg", "distribution": "pkg", "version": "1.0", "source": "pkg"},
    "build": {"backend": "pep517"},
    "publish": {"default_target": "local", "targets": {"local": {"url": "file://{out}/index"}}}}


def _config(tmp_path: Path, build_system: str = "", **variant: Any) -> KilnConfig:
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "setup.py").write_text("")
    if build_system:
        (tmp_path / "pyproject.toml").write_text(f"[build-system]\nrequires = {build_system}\n")
    table = {"name": "cpu", "backend": "cpu", "python": [KILN_PYTHON], "platform": ["x86_64", "aarch64"]} | variant
    return parse_config({**_BASE, "variants": [table]}, tmp_path)


def test_a_variant_of_two_cpus_is_one_cell_per_cpu_sharing_its_label(tmp_path: Path) -> None:
    cells = _config(tmp_path).variants
    minor = KILN_PYTHON.split(".")[1]
    assert [(c.name, c.platform, c.label) for c in cells] == [
        (f"cpupy3{minor}", ("x86_64",), "cpu"), (f"cpupy3{minor}aarch64", ("aarch64",), "cpu")]
    assert cross_target_of(cells[0], "x86_64") is None
    assert cross_target_of(cells[1], "x86_64") is not None and cross_target_of(cells[1], "aarch64") is None


def test_an_exclusion_may_name_a_cpu_and_one_the_variant_lacks_is_refused(tmp_path: Path) -> None:
    cells = _config(tmp_path, python=["3.10", KILN_PYTHON], exclude=[{"python": "3.10", "platform": "aarch64"}])
    assert [c.platform for c in cells.variants] == [("x86_64",), ("x86_64",), ("aarch64",)]
    with pytest.raises(ConfigError, match="exclude\\[0\\].platform = 'aarch64' matches no cell"):
        _config(tmp_path, platform=["x86_64"], exclude=[{"platform": "aarch64"}])


@pytest.mark.parametrize(("changes", "named"), [
    ({"backend": "cuda", "archs": ["9.0"]}, "a cuda variant's host code needs its toolkit's aarch64 cross target"),
    ({"build_requires": ["torch>=2.13"]}, "a torch extension (its build_requires name torch)"),
    ({"python": ["3.10"]}, "this one is for Python 3.10"),
])
def test_an_aarch64_cell_the_cross_path_cannot_build_is_refused_naming_the_variant_and_why(
        tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    config = _config(tmp_path, **changes)
    aarch64 = [v for v in config.variants if v.platform == ("aarch64",)]
    assert cross_refusal(config, aarch64[0], "x86_64")
    with pytest.raises(ConfigError, match="refused before anything builds") as info:
        check_cross_cells(config, machine="x86_64")
    assert f"variant {aarch64[0].name!r}" in str(info.value) and named in str(info.value)


def test_a_torch_extension_is_refused_by_its_projects_build_requirements_too(tmp_path: Path) -> None:
    config = _config(tmp_path, build_system='["setuptools", "torch>=2.4"]')
    with pytest.raises(ConfigError, match="the project's \\[build-system\\] requires name torch"):
        check_cross_cells(config, machine="x86_64")


def test_a_registry_projects_aarch64_variant_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    config = parse_config({**_BASE, "project": {**_BASE["project"], "registry": "pkg.registry:KERNELS"},
                           "build": {}, "variants": [{"name": "cpu", "backend": "cpu", "platform": ["aarch64"]}]},
                          tmp_path)
    with pytest.raises(ConfigError, match="variant 'cpu': platform = \\['aarch64'\\]: Kiln's own wheel builder"):
        check_cross_cells(config, machine="x86_64")


def test_two_cpus_without_any_other_axis_are_two_cells(tmp_path: Path) -> None:
    config = _config(tmp_path, python=[])
    assert [(v.name, v.platform, v.cell.python if v.cell else "-") for v in config.variants] == [
        ("cpu", ("x86_64",), None), ("cpuaarch64", ("aarch64",), None)]
    check_cross_cells(config, machine="x86_64")


def test_the_builders_own_cpu_and_a_servable_cell_pass(tmp_path: Path) -> None:
    check_cross_cells(_config(tmp_path), machine="x86_64")
    check_cross_cells(_config(tmp_path, platform=["x86_64"], python=["3.10"]), machine="x86_64")


def test_an_aarch64_cells_suite_is_not_run_on_an_x86_64_machine_and_says_what_proves_it() -> None:
    why = no_runner_reason(("aarch64",), "x86_64")
    assert why.startswith("not run: no aarch64 runner (this machine is x86_64)") and "KILN_TEST_AARCH64=1" in why
    assert no_runner_reason(("x86_64",), "x86_64") == "" and no_runner_reason(("aarch64",), "aarch64") == ""


def test_an_aarch64_wheels_dependencies_are_resolved_for_that_cpu() -> None:
    options = target_python("crossdot-0.1.0+cpu-cp311-cp311-manylinux_2_17_aarch64.whl")
    assert options[-2:] == ["--platform", "manylinux_2_17_aarch64"]
    assert "--platform" not in target_python("crossdot-0.1.0+cpu-py3-none-any.whl")



@pytest.mark.skipif(platform.machine() != "x86_64", reason="the cross path runs on an x86_64 builder")
def test_the_build_flows_plan_refuses_an_aarch64_cell_before_anything_builds(tmp_path: Path) -> None:
    from kiln.flows.build import plan_build_task

    config = _config(tmp_path, backend="cuda", archs=["9.0"])
    aarch64 = config.variants[-1].name
    with pytest.raises(ConfigError, match=f"variant '{aarch64}': .*a cuda variant's host code"):
        plan_build_task.fn(config, "0.1.0.dev20261207", None, None, Checkout())
    assert not (tmp_path / ".kiln").exists()  # nothing planned, cached or built


def test_a_variant_that_names_no_platform_is_for_the_builders_own_cpu(tmp_path: Path) -> None:
    _config(tmp_path)  # the project's paths
    config = parse_config({**_BASE, "variants": [{"name": "cpu", "backend": "cpu", "python": [KILN_PYTHON]}]},
                          tmp_path)
    [cell] = config.variants
    for machine in ("x86_64", "aarch64"):  # a Grace machine builds and tests its own wheels, natively
        assert built_for(cell, machine) == (machine,)
        assert cross_target_of(cell, machine) is None and cross_refusal(config, cell, machine) == ""
        assert no_runner_reason(built_for(cell, machine), machine) == ""
    check_cross_cells(config, machine="aarch64")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an aarch64 cell is foreign on an x86_64 machine")
def test_the_bench_stage_leaves_an_aarch64_cell_not_run_saying_its_cpu(tmp_path: Path) -> None:
    from kiln.tasks.bench.harness import bench_left

    config = _config(tmp_path)
    x86, arm = (v.name for v in config.variants)
    [left] = bench_left(config, x86)
    assert (left.id, left.state) == (f"bench/{arm}", "not_run")
    assert "wheel is for aarch64 (this machine is x86_64)" in left.message


def test_a_suite_that_asks_for_emulation_runs_where_the_machine_can_emulate_and_else_says_what_it_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.tasks.testing import emulation

    here = no_runner_reason(("aarch64",), "x86_64", emulate=True)
    assert here == "" if not emulation.missing_tools() else "cannot emulate aarch64: no " in here, here
    assert "no aarch64 runner" in no_runner_reason(("aarch64",), "x86_64")  # without emulate: not run
    assert "no x86_64 runner" in no_runner_reason(("x86_64",), "aarch64", emulate=True)  # only aarch64 on x86_64
    # fault injection: a machine without qemu-user-static
    monkeypatch.setattr(emulation, "missing_tools", lambda: ["/usr/bin/qemu-aarch64-static (Debian's qemu-user-static)"])
    reason = no_runner_reason(("aarch64",), "x86_64", emulate=True)
    assert reason.startswith("not run: the suite asks to run under emulation (emulate = true), but this machine"
                             " cannot emulate aarch64: no /usr/bin/qemu-aarch64-static"), reason


def test_an_emulated_suites_results_are_read_from_pytests_junit_report(tmp_path: Path) -> None:
    from kiln.tasks.testing.emulated import parse_junit

    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" time="0.5"/>'
                      '<testcase classname="tests.test_a" name="test_bad" time="1"><failure message="assert 1 == 2'
                      '&#10;more">trace</failure></testcase><testcase classname="tests.test_a" name="test_skip">'
                      '<skipped message="no GPU"/></testcase></testsuite></testsuites>')
    results = [(r.nodeid, r.outcome, r.duration_s, r.message) for r in parse_junit(report)]
    assert results == [("tests.test_a::test_ok", "passed", 0.5, ""), ("tests.test_a::test_bad", "failed", 1.0,
                                                                        "assert 1 == 2"),
                       ("tests.test_a::test_skip", "skipped", 0.0, "no GPU")]


def test_an_emulated_suite_of_a_python_the_userland_lacks_is_not_run_naming_both(tmp_path: Path) -> None:
    from kiln.tasks.testing import emulation

    reason = no_runner_reason(("aarch64",), "x86_64", emulate=True, python="3.12")
    assert reason == ("not run: the suite asks to run under emulation (emulate = true), but the emulated userland's"
                      f" CPython is {emulation.USERLAND_PYTHON} (bookworm); this cell is for Python 3.12")


def test_an_emulated_suite_runs_whole_so_shards_are_refused_naming_the_suite(tmp_path: Path) -> None:
    config = {**_BASE, "variants": [{"name": "cpu", "backend": "cpu"}],
              "suites": [{"name": "unit", "paths": ["tests"], "emulate": True, "shards": 2}]}
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "tests").mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match="suite 'unit': emulate = true runs the suite whole under emulation; give"
                                          " it shards = 1"):
        parse_config(config, tmp_path)
