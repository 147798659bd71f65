"""The planner reads the kernel registry through a sandboxed guest: data back, nothing of the package imported in
Kiln's process, no credential, no network, no write; plans and errors exactly as an in-process read gives them."""

from __future__ import annotations

import enum
import json
import socket
import sys
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.core.sandbox import support
from kiln.runtime.spec import KernelSpec, Specialization, TritonEntry
from kiln.tasks.build import stage
from kiln.tasks.build.plan import plan_build
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.project.config import load_config
from kiln.tasks.project.registry import load_registry, read_registry
from kiln.tasks.project.registry_guest import kernel_json, kernel_record, load_registry_data
from tests.helpers.projects import copy_project

ROOT = Path(__file__).resolve().parents[2]
sandboxed = bool(support().landlock_abi and support().namespaces)
TOOLCHAIN = {"triton": "3.0.0", "torch": "2.0.0"}


def _drop(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget another test's in-process import of ``package``, so this test sees only its own."""
    for name in [n for n in sys.modules if n.partition(".")[0] == package]:
        monkeypatch.delitem(sys.modules, name)


def _imported(package: str) -> list[str]:
    return [n for n in sys.modules if n.partition(".")[0] == package]


class Block(enum.IntEnum):
    SMALL = 64


def copy_kernel(x_ptr, out_ptr, n, BLOCK):  # any function: the plan reads only its module's name
    return None


def _kernel(constexprs: dict, options: dict) -> KernelSpec:
    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    return KernelSpec(name="copy", module="nosy.kern", supported={"cuda": ("8.0",)},
                      triton=(TritonEntry("copy_kernel", copy_kernel,
                                          (Specialization("s", signature, constexprs, options=options),)),))


@pytest.mark.parametrize("value", [64, 64.5, True, None, "fp32", Block.SMALL, (1, 2), [3], float("inf"), object])
def test_constexprs_and_options_round_trip_to_the_same_plan_keys_and_launch_fields(tmp_path, value):
    config = load_config(copy_project("nosy", tmp_path))
    records = read_registry(config, [_kernel({"BLOCK": value}, {"num_warps": value})])
    data = [kernel_record(json.loads(json.dumps(kernel_json(r)))) for r in records]
    assert plan_build(config, data, TOOLCHAIN) == plan_build(config, records, TOOLCHAIN)


@pytest.mark.slow  # torch and Triton, imported by the guest and by this process
def test_the_default_projects_plan_from_the_guests_data_equals_the_plan_from_its_records():
    config = load_config(ROOT / "kiln.toml")
    data = load_registry_data(config)
    records = load_registry(config)  # in this (test) process: the reference the guest's data must equal
    assert plan_build(config, data.kernels, TOOLCHAIN) == plan_build(config, records, TOOLCHAIN)
    assert data.bench_kernels == tuple(r.name for r in records if r.bench_cases is not None)
    assert data.bench_kernels  # the default project's kernels declare cases: its bench stage runs as before


def _break(config: Path, old: str, new: str) -> None:
    registry = config.parent / "nosy" / "registry.py"
    registry.write_text(registry.read_text().replace(old, new))


@pytest.mark.parametrize(("old", "new"), [
    ('{"BLOCK": 64}', '{"BLOCKS": 64}'),  # refused by validation, naming the kernel and the specialization
    ("import json\n", "import json\nimport not_a_module_anywhere\n"),  # the import fails
    ("    from nosy.kern", "    raise RuntimeError('no registry today')\n    from nosy.kern"),  # the call raises
])
def test_a_registry_error_arrives_from_the_guest_unchanged(tmp_path, monkeypatch, old, new):
    config = copy_project("nosy", tmp_path)
    _break(config, old, new)
    loaded = load_config(config)
    with pytest.raises(ConfigError) as from_guest:
        load_registry_data(loaded)
    _drop("nosy", monkeypatch)
    with pytest.raises(ConfigError) as in_process:
        load_registry(loaded)
    assert str(from_guest.value) == str(in_process.value)
    assert "project.registry = 'nosy.registry:registry'" in str(from_guest.value)


def test_a_guest_that_dies_is_a_clear_error_naming_the_entry_point(tmp_path):
    config = copy_project("nosy", tmp_path)
    _break(config, "import json\n", "import json\nimport os\nprint('going away', flush=True)\nos._exit(3)\n")
    with pytest.raises(ConfigError, match=r"'nosy.registry:registry': importing it \(in its sandbox\) ended with"
                                          r" exit status 3 and no result[\s\S]*going away"):
        load_registry_data(load_config(config))


def test_a_guest_past_its_deadline_is_ended_and_named(tmp_path):
    config = copy_project("nosy", tmp_path)
    _break(config, "import json\n", "import json\nimport time\ntime.sleep(600)\n")
    with pytest.raises(ConfigError, match=r"'nosy.registry:registry': importing it \(in its sandbox\) ran past its"
                                          r" 2 s deadline; ended by sigterm"):
        load_registry_data(load_config(config), timeout_s=2)


def test_the_planner_never_imports_a_nosy_registry_nor_hands_it_a_secret_a_write_or_the_network(tmp_path,
                                                                                               monkeypatch):
    config = copy_project("nosy", tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        (config.parent / "port").write_text(str(listener.getsockname()[1]))
        for name in ("AWS_SECRET_ACCESS_KEY", "PREFECT_API_KEY", "GITHUB_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_TOKEN"):
            monkeypatch.setenv(name, f"secret-{name.lower()}")
        _drop("nosy", monkeypatch)
        read = []

        def spy(*args, **kwargs):  # the real read, kept to look at what the registry saw
            read.append(load_registry_data(*args, **kwargs))
            return read[-1]

        monkeypatch.setattr(stage, "load_registry_data", spy)
        setup = prepare_build(str(config), "0.1.0", None, cache_dir=str(tmp_path / "cache"))
        assert [u.id for u in setup.plan.units] == ["build/cu130/8.0/copy/fp32_b64"]
        assert _imported("nosy") == []  # planned from data: the package never ran here
        (data,) = read
        found = json.loads(data.kernels[0].description)
        assert found["secrets"] == []
        if sandboxed:  # Landlock keeps the project read-only; a network namespace of its own has no listener
            assert found == {"secrets": [], "planted": False, "connected": False}
            assert not (config.parent / "planted").exists()
            with pytest.raises(BlockingIOError):
                listener.accept()


def test_a_head_start_reads_the_registry_in_its_guest_and_the_plan_takes_that_read(tmp_path, monkeypatch):
    config = copy_project("nosy", tmp_path)
    _drop("nosy", monkeypatch)
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return load_registry_data(*args, **kwargs)

    monkeypatch.setattr(stage, "load_registry_data", counting)
    try:
        stage.head_start(load_config(config))
    finally:
        stage.sparepool.discard()  # the compile workers it also started: not this test's subject
    assert _imported("nosy") == []
    setup = prepare_build(str(config), "0.1.0", None, cache_dir=str(tmp_path / "cache"))
    assert len(calls) == 1 and setup.plan.units
    assert _imported("nosy") == []
