"""The carry of the offline GPU check (benchmarks/gpu_carry.py, gpu_prepare.sh, gpu_check.sh --cpu).

The slow tests reach PyPI to prepare a carry, as the GPU check's preparation does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "benchmarks" / "gpu_carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_carry"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_carry = _load()


def _prepare(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_carry.py"), "prepare", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=900, check=False)


def test_a_carry_over_its_limit_is_refused_naming_its_largest_wheels(tmp_path: Path) -> None:
    (tmp_path / "big-1.0-py3-none-any.whl").write_bytes(b"x" * (2 * MIB))
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * (MIB // 2))

    assert gpu_carry.check_size(tmp_path, 3) == 2 * MIB + MIB // 2
    with pytest.raises(gpu_carry.CarryTooLargeError) as refused:
        gpu_carry.check_size(tmp_path, 2)
    assert "is 2.5 MiB, over its 2 MiB limit" in str(refused.value)
    assert "big-1.0-py3-none-any.whl (2.0 MiB)" in str(refused.value)


def test_the_machine_layer_holds_the_closure_of_what_it_provides_and_names_what_is_missing(tmp_path: Path) -> None:
    linked = gpu_carry.link_layer(["pytest"], tmp_path / "layer")

    assert {"pytest", "_pytest", "pluggy", "iniconfig", "packaging"} <= set(linked)
    assert (tmp_path / "layer" / "_pytest").resolve() == Path(pytest.__file__).resolve().parent.parent / "_pytest"
    with pytest.raises(gpu_carry.MachineMismatchError, match="no-such-dist .needed by the check. is not installed"):
        gpu_carry.link_layer(["no-such-dist"], tmp_path / "other")


def test_the_layer_follows_a_requirements_extras() -> None:
    """prefect asks for httpx[http2]: h2 comes with it, and not with httpx alone (torch's CUDA libraries too)."""
    def names(roots: list[str]) -> set[str]:
        return {canonicalize_name(d.metadata["Name"]) for d in gpu_carry.closure(roots)}

    assert "h2" in names(["prefect"])
    assert "h2" not in names(["httpx"])


@pytest.mark.slow
def test_a_target_kiln_does_not_accept_is_refused_naming_the_wheel_and_nothing_is_written(tmp_path: Path) -> None:
    done = _prepare(tmp_path / "carry", "--python-version", "3.10")

    assert done.returncode == 2, done.stderr
    assert "the target cannot be served: kiln requires Python >=3.11, the target is Python 3.10" in done.stderr
    assert not (tmp_path / "carry").exists()


@pytest.mark.slow
def test_a_target_with_no_wheel_for_a_distribution_is_refused_naming_it(tmp_path: Path) -> None:
    done = _prepare(tmp_path / "carry", "--python-version", "3.99")

    assert done.returncode == 2, done.stderr
    refusal = done.stderr.strip().splitlines()[-1]
    assert "the target cannot be served: " in refusal and "has no wheel for Python 3.99" in refusal, refusal
    named = refusal.split("the target cannot be served: ")[1].split(" ")[0]
    # A distribution of the carry's closure (each is installed here, at the version the carry pins), by name.
    assert f"{named} ({named}=={metadata.version(named)})" in refusal, refusal
    assert not (tmp_path / "carry").exists()


@pytest.mark.slow
def test_the_h200_carry_holds_only_cp312_manylinux_wheels_and_nothing_the_machine_has(tmp_path: Path) -> None:
    """The default target (the H200: Python 3.12, torch 2.11.0, Triton 3.6.0), read back from the wheel tags."""
    done = _prepare(tmp_path / "carry")

    assert done.returncode == 0, done.stderr
    wheels = sorted((tmp_path / "carry").glob("*.whl"))
    names = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
    assert {"kiln", "kiln-runtime", "kiln-kernels", "prefect", "pydantic", "pydantic-core", "pytest", "uv"} <= names
    assert not names & {"torch", "triton", "numpy", "apprise"}
    assert not [n for n in names if n.startswith("nvidia-")]
    for wheel in wheels:
        tags = parse_wheel_filename(wheel.name)[3]
        assert any(t.interpreter in ("py3", "cp312") or (t.abi == "abi3" and t.interpreter <= "cp312")
                   for t in tags), wheel.name
        assert any(t.platform == "any" or (t.platform.endswith("_x86_64") and t.platform.startswith("manylinux")
                                           and t.platform <= "manylinux_2_28_x86_64") for t in tags), wheel.name
    assert any(t.interpreter == "cp312" for w in wheels for t in parse_wheel_filename(w.name)[3])
    size = sum(p.stat().st_size for p in (tmp_path / "carry").iterdir())
    assert size <= 60 * MIB
    assert f"{size / MIB:.1f} MiB (limit 60 MiB), for Python 3.12, torch 2.11.0, Triton 3.6.0" in done.stdout
    manifest = json.loads((tmp_path / "carry" / "carry.json").read_text())
    assert manifest["target"]["python_version"] == "3.12" and manifest["provided"] == ["torch", "triton", "numpy"]


def _can_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="gpu_check.sh --cpu needs a network namespace (unshare -n, as root)")
def test_the_cpu_check_installs_only_the_carry_with_no_network_and_benches_to_completion(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu", "--carry", str(tmp_path / "carry")],
                          capture_output=True, text=True, timeout=1500, env=env, check=False)

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["network"].startswith("none"), result["network"]
    assert {s["step"]: s["state"] for s in result["steps"]} == {
        "setup": "passed", "gpu_tests": "skipped", "aot_selfcheck": "skipped", "bench": "passed"}
    carried = {f"{canonicalize_name(parse_wheel_filename(w.name)[0])}=={parse_wheel_filename(w.name)[1]}"
               for w in (tmp_path / "carry").glob("*.whl")}
    installed = {f"{canonicalize_name(d.split('==')[0])}=={d.split('==')[1]}"
                 for d in json.loads((tmp_path / "out" / "installed.json").read_text())}
    assert installed == carried
    results = json.loads((tmp_path / "out" / "bench_cpu.json").read_text())
    assert {c["kernel"] for c in results["cases"]} >= {"per_token_quant"}
    assert all(c["metric"] == "cpu" for c in results["cases"])


def test_a_machine_that_is_not_the_carrys_target_is_refused_naming_what_differs_and_what_is_missing() -> None:
    import torch

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    triton = metadata.version("triton")
    manifest = {"target": {"python_version": here, "torch_version": "9.9.9", "triton_version": triton}}

    with pytest.raises(gpu_carry.MachineMismatchError) as refused:
        gpu_carry.check_machine(manifest, imports=("json", "no_such_module_of_the_check"))
    message = str(refused.value)
    assert f"this machine is not the carry's target: torch {torch.__version__.split('+')[0]} (the carry is for 9.9.9)" \
        in message
    assert "triton" not in message.split("cannot import")[0]
    assert "cannot import (add its distribution to benchmarks/gpu_carry.toml `needs`): no_such_module_of_the_check " \
        "(ModuleNotFoundError: No module named 'no_such_module_of_the_check')" in message
    manifest["target"]["torch_version"] = torch.__version__
    gpu_carry.check_machine(manifest, imports=("json",))
