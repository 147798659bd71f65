"""Per-variant build environments: made once under concurrent builds, a failure names what failed, and a
CUDA variant whose build environment's torch has no CUDA is refused before anything builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.core import venvs
from kiln.core.manifest import RunManifest
from kiln.core.sandbox import support
from kiln.tasks.build.buildenv import (
    PARENT_SITE,
    BuildEnvironment,
    BuildEnvironmentError,
    VariantEnvironments,
    ensure_env,
    env_key,
    overlay_env,
    probe_torch,
)
from kiln.tasks.project.config_project import pinned_version
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from tests.helpers.hostile import Listener
from tests.helpers.projects import copy_project
from tests.helpers.sdists import evil_sdist_index, probing_sdist_index

REPO = Path(__file__).resolve().parents[2]


def local_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A small wheel on disk (a requirement pip installs without any index)."""
    dist_info = f"{name}-{version}.dist-info"
    members = {**files, f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
               f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kiln-test\nRoot-Is-Purelib: true\n"
                                     b"Tag: py3-none-any\n"}
    return write_wheel(directory, f"{name}-{version}-py3-none-any.whl", sorted(members.items()), WheelStamp())


def test_the_key_is_the_sorted_requirements_spelled_canonically():
    assert env_key(["b>=1", "a==2"]) == env_key(["a==2", "b >= 1"])
    assert env_key(["a==2"]) != env_key(["a==3"])


@pytest.mark.parametrize(("requirements", "pin"), [(["torch==2.14.1"], "2.14.1"), (["numpy", "torch>=2.6"], None),
                                                   (["torch==2.14.*"], None), (["numpy==2.0"], None)])
def test_the_torch_a_wheel_pins_is_the_exact_version_its_variant_requires(requirements, pin):
    assert pinned_version(requirements) == pin


_RACER = """
import json, sys, time
from pathlib import Path
from kiln.tasks.build.buildenv import ensure_env
root, requirement, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
made = ensure_env(root, [requirement], sys.argv[4], 600)
print(json.dumps({"created": made.created, "root": str(made.root)}))
"""


@pytest.mark.slow
def test_two_concurrent_builds_make_one_environment_and_both_use_it(tmp_path):
    wheel = local_wheel(tmp_path / "wheels", "kilntinydep", "1.0", {"kilntinydep/__init__.py": b"VALUE = 42\n"})
    requirement = f"kilntinydep @ {wheel.as_uri()}"
    root, go = tmp_path / "envs", tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), requirement, str(go), variant],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
              for variant in ("cu130", "cu130-again")]
    go.touch()  # both start together
    results = []
    for racer in racers:
        out, err = racer.communicate(timeout=600)
        assert racer.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["created"] for r in results) == [False, True]  # one made it, the other used it
    assert results[0]["root"] == results[1]["root"]
    made = Path(results[0]["root"])
    assert sorted(p.name for p in root.iterdir()) == sorted([made.name, f"{made.name}.lock"])  # no temporary left
    probe = subprocess.run([str(made / "bin" / "python"), "-I", "-c", "import kilntinydep; print(kilntinydep.VALUE)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "42", probe.stderr
    # The scripts pip wrote point at the final path, not the temporary one they were made in.
    assert (made / "bin" / "pip").read_text().splitlines()[0] == f"#!{made}/bin/python"


@pytest.mark.slow
def test_a_failed_creation_names_the_variant_and_the_requirement_and_leaves_nothing(tmp_path):
    root = tmp_path / "envs"
    with pytest.raises(BuildEnvironmentError) as caught:
        ensure_env(root, ["kiln-no-such-distribution-anywhere==1.0"], "cu130", 600)
    message = str(caught.value)
    assert "the build environment of variant cu130" in message
    assert "kiln-no-such-distribution-anywhere==1.0" in message
    assert "No matching distribution" in message or "ERROR" in message  # pip's own words, its output's tail
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_a_build_requirements_sdist_hook_runs_without_the_steps_secrets(tmp_path, monkeypatch):
    """A build requirement that an index holds only as an sdist: pip runs its build hook, someone else's code,
    with no cloud credential or Prefect API key and a private HOME, while the machine's sources still apply."""
    markers = tmp_path / "markers"
    evil = evil_sdist_index(tmp_path / "evil", markers)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "step-secret")
    monkeypatch.setenv("PREFECT_API_KEY", "prefect-secret")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", evil)  # a machine source: kept for a build environment
    with pytest.raises(BuildEnvironmentError):
        ensure_env(tmp_path / "envs", ["evil-sdist"], "cu130", 600)  # its backend builds nothing
    seen = [json.loads(p.read_text()) for p in markers.iterdir()] if markers.exists() else []
    if support().landlock_abi and support().namespaces:
        assert not seen, seen  # sandboxed, the hook (which ran: the test below) cannot write its marker outside
        return
    assert seen, "the premise: pip found the sdist through the machine's source and ran its build hook"
    for environ in seen:
        assert "AWS_SECRET_ACCESS_KEY" not in environ and "PREFECT_API_KEY" not in environ, sorted(environ)
        assert environ.get("HOME") != str(Path.home())


@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="needs Landlock and user namespaces (the sandbox the installer runs in)")
def test_a_build_requirement_an_index_holds_as_an_sdist_is_refused_and_one_named_by_file_builds_without_network(
        tmp_path, monkeypatch):
    """pip fills a build environment as a guest with the machine's network, taking only wheels from an index: an
    sdist there is refused and its build hook never runs. An sdist the project names by file is built by Kiln
    first, sandboxed with no network: its hook reads no file of the user's, writes nothing beside it, sees no
    credential and reaches no listener; the environment gets its wheel."""
    secret, outside = tmp_path / "home" / ".netrc", tmp_path / "home" / "planted.txt"
    secret.parent.mkdir()
    secret.write_text("machine pypi.org password hunter2")
    cache = tmp_path / "pip-cache"
    monkeypatch.setenv("PIP_CACHE_DIR", str(cache))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "step-secret")
    listener = Listener()
    try:
        index = probing_sdist_index(tmp_path / "probe", secret, outside, connect=(listener.host, listener.port))
        monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index)
        with pytest.raises(BuildEnvironmentError, match="only wheels from an index") as refused:
            ensure_env(tmp_path / "envs", ["probe-sdist"], "cu130", 600)
        assert "probe-sdist" in str(refused.value) and not list(cache.glob("probe-*.json"))  # the hook never ran
        sdist = tmp_path / "probe" / "simple" / "probe-sdist" / "probe_sdist-1.0.tar.gz"
        made = ensure_env(tmp_path / "envs", [f"probe-sdist @ {sdist.as_uri()}"], "cu130", 600)
    finally:
        listener.close()
    report = json.loads((venvs.site_packages(made.python) / "probe_sdist_report.json").read_text())
    assert report.get("secret_error") == "PermissionError" and "secret" not in report, report
    assert report["wrote_outside"] is False and "AWS_SECRET_ACCESS_KEY" not in report["environ"]
    assert report["connected"] is False and listener.accepted == 0
    assert not outside.exists()


def fake_cpu_torch(directory: Path) -> str:
    """A requirement for a torch built without CUDA, as the preflight sees one (torch.version.cuda is None).

    A stand-in for the real CPU torch (a 700 MB environment): the preflight reads only these attributes.
    """
    wheel = local_wheel(directory, "torch", "2.13.0+cpu", {
        "torch/__init__.py": b"__version__ = '2.13.0+cpu'\nfrom torch import version\n",
        "torch/version.py": b"__version__ = '2.13.0+cpu'\ncuda = None\nhip = None\n"})
    return f"torch @ {wheel.as_uri()}"


@pytest.mark.slow
def test_a_cuda_variant_whose_build_environment_torch_has_no_cuda_is_refused_naming_torch_and_the_fix(tmp_path):
    envs = VariantEnvironments(tmp_path / "envs", {"cu130": ("cuda", (fake_cpu_torch(tmp_path / "w"),)),
                                                   "cpu": ("cpu", ())}, 600)
    with pytest.raises(BuildEnvironmentError) as caught:
        envs.for_variant("cu130")
    message = str(caught.value)
    assert "variant cu130 is a CUDA variant" in message and "(2.13.0+cpu)" in message
    assert 'add build_requires = ["torch==2.14.1"]' in message and "to variant cu130" in message
    with pytest.raises(BuildEnvironmentError):  # every unit of the variant gets the same answer, made once
        envs.for_variant("cu130")
    assert envs.for_variant("cpu") is None  # no build_requires: Kiln's own environment, as before
    torch = probe_torch(next(p for p in (tmp_path / "envs").iterdir() if p.is_dir()) / "bin" / "python")
    assert torch is not None and torch.cuda is None


@pytest.mark.slow
def test_the_build_refuses_the_cuda_variant_before_its_backend_runs(prefect_server, tmp_path):
    from kiln.flows.build import build_flow

    config = copy_project("plaincuda", tmp_path)
    requirement = fake_cpu_torch(tmp_path / "w")
    text = config.read_text().replace('archs = ["8.0", "9.0"]',
                                      f'archs = ["8.0", "9.0"]\nbuild_requires = ["{requirement}"]')
    config.write_text(text)
    out = tmp_path / "out"
    start = time.monotonic()
    state = build_flow(str(config), str(out), version="1.0.0.dev20261203", variants=["cu130"], return_state=True)
    assert state.is_failed()
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    unit = next(u for u in run.units if u.id.endswith("/pep517"))
    assert unit.state == "failed" and "BuildEnvironmentError" in unit.message
    assert "torch of its build environment (2.13.0+cpu)" in unit.message
    assert "the build backend failed" not in unit.message  # refused before the project's build ran
    assert time.monotonic() - start < 600
    assert os.path.isdir(config.parent / ".kiln" / "cache" / "envs")  # made under the build cache


def test_torch_settings_read_from_an_environments_python_match_the_imported_torch():
    from kiln.tasks.build.nvcc import torch_settings

    assert torch_settings(sys.executable) == torch_settings()  # python -I -c, in a process of its own


def test_build_env_is_exported_to_the_variants_build_and_part_of_its_cache_key(tmp_path):
    from kiln.tasks.build.plan import backend_unit
    from kiln.tasks.build.stage import project_builder
    from kiln.tasks.project.config import load_config

    config_path = copy_project("plaincuda", tmp_path)
    text = config_path.read_text()
    keys = []
    for value in ("1", "2"):
        config_path.write_text(text.replace('archs = ["8.0", "9.0"]',
                                            f'archs = ["8.0", "9.0"]\nbuild_env = {{PLAINCUDA_FAST = "{value}"}}'))
        config = load_config(config_path)
        unit = backend_unit(config, config.variant("cu130"), {"nvcc": "13.0"})
        keys.append(unit.key)
    builder = project_builder(config, [config.variant("cpu")], None, {})
    made = BuildEnvironment(tmp_path / "env", ("torch==2.14.1",))
    environ = builder.environ(unit, made)
    assert environ["PLAINCUDA_FAST"] == "2" and environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert environ["PATH"].split(os.pathsep)[0] == str(tmp_path / "env" / "bin")  # its ninja, cmake first
    assert "PLAINCUDA_FAST" not in builder.environ(backend_unit(config, config.variant("cpu"), {}), None)
    assert keys[0] != keys[1]


def test_an_overlay_names_the_shared_environments_packages_inside_itself(tmp_path):
    """A package's build imports the shared environment's packages (torch) through a link inside the unit's
    overlay, so its compiles' include paths lie below the unit's folder (the compile cache's base directory) on
    every worker and clone, wherever that worker keeps its shared environments."""
    shared = BuildEnvironment(tmp_path / "elsewhere" / "env", ())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(shared.root)], check=True, timeout=300)
    package = venvs.site_packages(shared.python) / "kiln_probe_shared"
    package.mkdir()
    (package / "__init__.py").write_text("")
    python = overlay_env(tmp_path / "unit" / "env", shared)
    found = subprocess.run([str(python), "-I", "-c", "import kiln_probe_shared as m; print(m.__file__)"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert found == str(tmp_path / "unit" / "env" / PARENT_SITE / "kiln_probe_shared" / "__init__.py")
    assert Path(found).resolve() == (package / "__init__.py").resolve()
