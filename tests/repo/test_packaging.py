"""What installing Kiln puts into site-packages: one import name, ``kiln``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


_ANYWHERE = shutil.ignore_patterns(".git", ".venv", ".kiln", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache")
_AT_ROOT = {"build", "dist", "out"}  # setuptools' and Kiln's outputs; tasks/build is a source package


def _not_sources(directory: str, names: list[str]) -> set[str]:
    ignored = set(_ANYWHERE(directory, names))
    return ignored | (_AT_ROOT & set(names) if Path(directory) == REPO else set())


@pytest.fixture(scope="module")
def kiln_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kiln-wheel")
    # Built from a copy: setuptools leaves kiln.egg-info and build/ beside the sources it builds, and a
    # kiln.egg-info in the checkout would shadow the installed distribution's metadata for later tests.
    source = tmp_path_factory.mktemp("kiln-source") / "kiln"
    shutil.copytree(REPO, source, symlinks=True, ignore=_not_sources)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, timeout=600, capture_output=True)
    (wheel,) = out.glob("kiln-*.whl")
    return wheel


def test_the_kiln_distribution_installs_only_the_kiln_import_name(kiln_wheel):
    with zipfile.ZipFile(kiln_wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    installed = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert installed == {"kiln"}
    assert top_level == ["kiln"]
    assert "kiln/__init__.py" not in names  # a namespace: kiln-runtime adds kiln/runtime beside it
    for package in ("flows", "tasks", "release", "tasks/build", "tasks/testing", "tasks/bench"):
        assert f"kiln/{package}/__init__.py" in names, package


def test_the_pipeline_and_the_runtime_share_one_namespace():
    import kiln
    import kiln.flows
    import kiln.runtime

    assert getattr(kiln, "__file__", None) is None  # PEP 420 namespace, no kiln/__init__.py
    assert kiln.flows.__name__ == "kiln.flows" and kiln.runtime.KernelSpec.__module__ == "kiln.runtime.spec"
