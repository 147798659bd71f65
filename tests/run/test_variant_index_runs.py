"""A nightly of the tiny fixture publishes its PEP 825 variant wheels into the channel's combined index, and
uv (with its wheel-variants preview) chooses the variant the machine supports from it, pip the default wheel.

The tiny fixture project committed in its own git repository, run by the real nightly flow under the session's
Prefect server; the installs are real uv and pip runs into fresh venvs from the index's file:// URL, with
``--no-deps`` (tinyk's kiln-runtime and triton say nothing about the choice). What uv 0.13 is told of the
machine: nothing (no GPU: the null variant), or a CUDA 13 driver and an sm_90 GPU through its NVIDIA provider's
``NV_VARIANT_PROVIDER_FORCE_*`` variables (the cu130 variant), as in tests/build/test_variants.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.release.publish.plan import COMBINED
from kiln.release.read.verify import verify_index
from tests.helpers.gitrepo import git, git_project
from tests.helpers.indexcheck import check_local_index

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
CUDA13 = {"NV_VARIANT_PROVIDER_FORCE_CUDA_DRIVER_VERSION": "13.0", "NV_VARIANT_PROVIDER_FORCE_SM_ARCH": "9.0"}


def _nightly(config: Path, out: Path) -> RunManifest:
    from kiln.flows.nightly import nightly_flow

    state = nightly_flow(config_path=str(config), out=str(out), return_state=True)
    assert state.is_completed(), state.message
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "NV_VARIANT_", "VIRTUAL_ENV", "PIP_"))}
    return {**keep, "PIP_CONFIG_FILE": os.devnull, "HOME": str(tmp_path), **extra}


def _installed_label(venv: Path, version: str) -> str:
    """The variant label of the tiny-kernels installed in ``venv`` ('' for the plain default wheel)."""
    (info,) = (venv / "lib").glob("python*/site-packages/tiny_kernels-*.dist-info")
    assert info.name == f"tiny_kernels-{version}.dist-info"
    variant = info / "variant.json"
    return next(iter(json.loads(variant.read_text())["variants"])) if variant.exists() else ""


def _uv(uv: str, tmp_path: Path, url: str, name: str, version: str, env: dict[str, str]) -> str:
    venv = tmp_path / f"venv-{name}"
    subprocess.run([uv, "venv", "-q", "--no-config", str(venv)], check=True, timeout=120, env=_clean_env(tmp_path))
    done = subprocess.run([uv, "pip", "install", "-q", "--no-config", "--no-cache", "--preview-features",
                           "wheel-variants", "--no-deps", "--python", str(venv / "bin" / "python"), "--index-url", url,
                           "tiny-kernels"], capture_output=True, text=True, timeout=300,
                          env=_clean_env(tmp_path, **env))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _installed_label(venv, version)


def test_a_nightly_publishes_the_combined_index_uv_installs_the_machines_variant_and_pip_the_default(
    prefect_server, tmp_path: Path
) -> None:
    config = git_project("tiny", tmp_path)
    out = tmp_path / "out"
    run = _nightly(config, out)
    commit = git(config.parent, "rev-parse", "HEAD")
    version = str(run.version)
    channel = out / "index" / "nightly"
    combined = channel / COMBINED / "simple"
    url = combined.as_uri() + "/"
    assert url in run.info["index_url"]
    commit_url = (channel / COMBINED / "commits" / commit[:12] / "simple").as_uri() + "/"
    assert commit_url in run.info["commit_index_url"]
    page = json.loads((combined / "tiny-kernels" / "index.json").read_text())
    names = sorted(f["filename"] for f in page["files"])
    assert [n.removesuffix(".whl").rsplit("-", 1)[-1] for n in names if n.endswith(".whl")] == [
        "null", "any", "cu130", "rocm"]  # "any": the plain default wheel, no label; no +local wheel
    assert names[-1] == f"tiny_kernels-{version}-variants.json"
    assert not any("+" in n for n in names)
    assert not check_local_index(out / "index").problems
    report = verify_index(url, install=False)  # the variants file against every variant wheel's variant.json
    assert report.ok, report.summary()
    # kiln verify installs from it too: uv with its wheel-variants preview (the null variant here), pip the default
    installed = verify_index(url, install=True)
    assert installed.ok and installed.wheel_variants, installed.summary()
    assert {f"pip tiny-kernels=={version}", f"uv tiny-kernels=={version}"} <= set(installed.installs)
    # the summary's command for it is uv's, with the preview
    from kiln.flows.report.summary import render_text

    # (run under `env -u ...` with --no-config, so no uv configuration of the caller's adds a source)
    (line,) = [line for line in render_text(run).splitlines()
               if line.strip().startswith("install: env ") and " uv pip install --no-config " in line and url in line]
    assert "--preview-features wheel-variants" in line and f"tiny-kernels=={version}" in line

    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    assert _uv(uv, tmp_path, url, "none", version, {}) == "null"
    assert _uv(uv, tmp_path, url, "cuda13", version, CUDA13) == "cu130"
    assert _uv(uv, tmp_path, commit_url, "commit", version, CUDA13) == "cu130"  # the commit's index the same
    venv = tmp_path / "venv-pip"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-cache-dir", "--no-deps", "--isolated", "--index-url", url, "tiny-kernels"],
                         capture_output=True, text=True, timeout=300, env=_clean_env(tmp_path, **CUDA13))
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    assert _installed_label(venv, version) == ""
