"""The resolvers Kiln runs before anything builds read wheels only and see no secret (DESIGN invariants 12, 14).

Real parts: the ``uv pip compile`` of suite planning (whether a stable-ABI suite's torch can be had) and of the
matrix cells' resolve check (:func:`kiln.tasks.build.plan.prepare_build`), run by real uv against file://
indexes standing for the machine's pip sources: one holding ``setuptools`` as a wheel, one holding the cell's
``torch`` only as an sdist whose build backend writes a marker with the environment it ran with. ``uv`` on
``PATH`` is a wrapper that records the environment it was started with, then runs the real uv: what the
resolver's process sees, read from the process itself.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from kiln.release.cli import index_command
from kiln.tasks.build.interpreters import CellUnavailableError
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.testing.suite import _cannot_resolve
from tests.helpers.projects import copy_project
from tests.helpers.sdists import evil_sdist_index
from tests.helpers.wheelkit import make_wheel

SECRETS = {"AWS_SECRET_ACCESS_KEY": "resolver-secret", "PREFECT_API_KEY": "prefect-secret",
           "GITHUB_TOKEN": "gh-secret"}
TORCH = "2.99.0"


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The machine's pip sources are two file:// indexes (setuptools as a wheel; torch as an sdist only), the
    caller holds secrets, and the ``uv`` on PATH records its environment: (the markers, the recorded envs)."""
    markers, seen = tmp_path / "markers", tmp_path / "uv-envs"
    make_wheel(tmp_path / "wheels", "setuptools", "70.0")
    assert index_command(str(tmp_path / "wheels"), None, str(tmp_path / "plain")) == 0
    evil = evil_sdist_index(tmp_path / "evil", markers, name="torch", version=TORCH)
    real = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    assert real, "uv is a test dependency"
    wrapper = tmp_path / "bin" / "uv"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nmkdir -p {seen}\n{sys.executable} -I -c "import json, os, sys; '
                       f'open(sys.argv[1], \'w\').write(json.dumps(dict(os.environ)))" {seen}/$$.json\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no user pip.conf adds the machine's real sources
    for name in ("PIP_CONFIG_FILE", "PIP_FIND_LINKS", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "plain").as_uri() + "/")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", evil)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return markers, seen


def _recorded(seen: Path) -> list[dict[str, str]]:
    envs = [json.loads(path.read_text()) for path in seen.glob("*.json")]
    assert envs, "the resolver never ran uv"
    return envs


def test_suite_planning_resolves_wheels_only_and_its_resolver_sees_no_secret(sources):
    markers, seen = sources
    why = _cannot_resolve(TORCH)
    assert why, "an sdist-only torch must not resolve"
    assert not markers.exists(), "the sdist's build hook ran"
    for env in _recorded(seen):
        assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
        assert env["HOME"] != os.environ["HOME"] and env.get("UV_CACHE_DIR")


def test_the_matrix_cells_resolve_check_reads_wheels_only_and_its_resolver_sees_no_secret(tmp_path, sources):
    markers, seen = sources
    config_path = copy_project("cmatrix", tmp_path / "project")
    config_path.write_text(config_path.read_text().replace('python = ["3.10", "3.11", "3.12", "3.13"]',
                                                           f'python = ["3.11"]\ntorch = ["{TORCH}"]'))
    with pytest.raises(CellUnavailableError) as refused:
        prepare_build(str(config_path), "1.0.0", None, cache_dir=str(tmp_path / "cache"))
    assert f"cell cpupy311 (Python 3.11): torch=={TORCH} cannot be had here" in str(refused.value)
    assert not markers.exists(), "the sdist's build hook ran"
    for env in _recorded(seen):
        assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
        assert env["HOME"] != os.environ["HOME"] and env.get("UV_CACHE_DIR")
