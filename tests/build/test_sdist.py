"""A pep517 project's sdist (kiln.tasks.build.sdist): the release's version, built as the wheel is, or refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.core.errors import CompileError, ConfigError
from kiln.tasks.build.guest_install import REFUSING_PROXY
from kiln.tasks.build.sdist import build_sdist, sdist_environ
from kiln.tasks.project.config import load_config

REPO = Path(__file__).resolve().parents[2]
JITK = REPO / "tests" / "fixtures" / "projects" / "jitk"  # setuptools, version 0.4.0 written in pyproject.toml
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"  # a registry package: Kiln's own wheel builder


def test_the_hooks_reach_no_download_host_and_setuptools_scm_is_told_the_release_version():
    env = sdist_environ({"HTTPS_PROXY": "http://proxy.corp:3128", "NO_PROXY": "*", "PATH": "/bin"}, "Jit.Kernels",
                        "0.4.0")
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["http_proxy"] == REFUSING_PROXY
    assert "NO_PROXY" not in env and env["PATH"] == "/bin"
    assert env["SETUPTOOLS_SCM_PRETEND_VERSION"] == env["SETUPTOOLS_SCM_PRETEND_VERSION_FOR_JIT_KERNELS"] == "0.4.0"


def test_an_sdist_at_the_release_version_is_built_and_another_version_is_refused_naming_both(tmp_path):
    project = shutil.copytree(JITK, tmp_path / "jitk")
    sdist = build_sdist(project, "jit-kernels", "0.4.0+cpu", tmp_path / "out", timeout_s=300)
    assert sdist == tmp_path / "out" / "jit_kernels-0.4.0.tar.gz" and sdist.stat().st_size > 0
    with pytest.raises(CompileError, match=r"jit_kernels-0\.4\.0\.tar\.gz states version 0\.4\.0, but the release"
                                           r" is 0\.5\.0: write 0\.5\.0 in the project's version"):
        build_sdist(project, "jit-kernels", "0.5.0", tmp_path / "refused", timeout_s=300)
    assert not (tmp_path / "refused").exists()  # nothing left where the release would look


def test_an_upload_target_of_a_registry_package_cannot_ship_an_sdist(tmp_path):
    root = shutil.copytree(TINY, tmp_path / "tiny", ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    config = root / "kiln.toml"
    config.write_text(config.read_text() + "\n".join([
        "", "[publish.targets.pypi]", 'kind = "upload"', 'url = "https://upload.pypi.org/legacy/"',
        'index_url = "https://pypi.org/simple/"', 'pypi_variant = "cpu"', "sdist = true", ""]))
    with pytest.raises(ConfigError, match=r"publish\.targets\.pypi\.sdist: only a project built by its own backend"):
        load_config(config)
