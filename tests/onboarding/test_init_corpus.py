"""kiln init on a corpus of public kernel packages, as published: each sdist's kiln.toml, checked against the
package's own PKG-INFO (name, version, requires-python) and the facts pinned beside it (import package, kind,
variants, build switches). Static only: kiln init reads the sdist, nothing builds it. The `real_corpus` tier
(`pytest -m real_corpus`), also part of the default run, so CI's README test line runs it."""

from __future__ import annotations

import tomllib
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from kiln.tasks.onboarding import init_project
from tests.helpers.real_packages import download_sdist, load_pin, pinned_names

DEFAULT_REQUIRES_PYTHON = ">=3.10"  # what kiln init writes where a package declares none


def _pkg_info(sdist: Path) -> dict[str, str]:
    message = Parser().parsestr((sdist / "PKG-INFO").read_text(encoding="utf-8"), headersonly=True)
    return {k: str(v) for k, v in message.items()}


@pytest.mark.real_corpus
@pytest.mark.real_package
@pytest.mark.parametrize("name", pinned_names())
def test_kiln_init_infers_what_a_public_kernel_package_says_of_itself(name, tmp_path):
    pin = load_pin(name)
    sdist = download_sdist(pin, tmp_path)
    info = _pkg_info(sdist)
    result = init_project(sdist)
    written = tomllib.loads(result.text)
    project = written["project"]
    assert canonicalize_name(project["distribution"]) == canonicalize_name(info["Name"])
    assert project["package"] == pin.import_name and project["source"].split("/")[-1] == pin.import_name
    declared, base = Version(info["Version"]), Version(project["version"])
    assert Version(f"{base}.dev0") > declared and base.release[:2] == declared.release[:2]  # nightlies sort above
    requires = info.get("Requires-Python", DEFAULT_REQUIRES_PYTHON)
    assert SpecifierSet(project["requires_python"]) == SpecifierSet(requires)
    assert result.findings.kind == pin.kind
    assert [v["name"] for v in written["variants"]] == list(pin.variants), result.findings.reasons
    gpu = [v for v in written["variants"] if v["backend"] == "cuda"]
    assert (gpu[0].get("build_env", {}) if gpu else {}) == pin.build_env, result.findings.reasons
    for variant in [v for v in written["variants"] if v["backend"] != "cuda"]:  # cpu, or one portable wheel
        assert variant.get("build_env", {}) == pin.cpu_build_env, (variant["name"], result.findings.reasons)
    named = {line.split()[1]: line for line in result.text.splitlines() if line.startswith("#   ") and "(" in line}
    for variable, what in pin.also_read.items():  # read by its build, not set, and said what it controls
        assert variable in named and f"({what}, " in named[variable], (variable, sorted(named))
    assert not [p for p in result.findings.missing_sources if (sdist / p).exists()]  # never a false alarm


@pytest.mark.real_corpus
@pytest.mark.real_package
def test_an_sdist_that_ships_none_of_the_sources_its_setup_py_names_is_reported_with_exit_status_1(
        tmp_path, capsys):
    from kiln.flows.cli import main

    sdist = download_sdist(load_pin("fast-hadamard-transform"), tmp_path)
    named = ["csrc/fast_hadamard_transform.cpp", "csrc/fast_hadamard_transform_cuda.cu"]
    assert all(f'"{p}"' in (sdist / "setup.py").read_text() for p in named) and not (sdist / "csrc").exists()
    assert main(["init", str(sdist)]) == 1
    assert f"its build names native sources {sdist} does not hold: {', '.join(named)}" in capsys.readouterr().err


@pytest.mark.real_corpus
@pytest.mark.real_package
def test_a_real_build_that_requires_its_cuda_major_fails_with_the_setting_to_change(tmp_path):
    """torch-memory-saver's setup.py raises "TMS_CUDA_MAJOR env var must be set ..." where the variable is unset:
    its build, run for real (pip's build of the sdist, as a first nightly's backend would run it, with nvcc on PATH
    so it takes its CUDA path), fails before any compile, and what it printed names the setting."""
    import os
    import shutil
    import subprocess
    import sys

    from kiln.tasks.onboarding.advice import what_to_set

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: the package's setup.py would not take its CUDA path")
    sdist = download_sdist(load_pin("torch-memory-saver"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("TMS_CUDA_MAJOR", "TMS_PLATFORM")}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                           str(tmp_path / "wheels"), str(sdist)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and not list((tmp_path / "wheels").glob("*.whl")), done.stdout[-2000:]
    printed = done.stdout + done.stderr
    raised = next(line.strip() for line in printed.splitlines() if "RuntimeError: TMS_CUDA_MAJOR" in line)
    assert what_to_set(sdist, "cu130", "cuda", {}, printed) == [
        f"its build printed {raised!r}: add TMS_CUDA_MAJOR = \"13\" to [[variants]] cu130 build_env"]
