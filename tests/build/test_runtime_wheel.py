"""The kiln-runtime wheel the publish stage puts in every index beside the kernel wheels."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata

from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel

TIMEOUT_S = 300


def test_runtime_wheel_carries_the_runtime_package_and_its_metadata(tmp_path):
    wheel = build_runtime_wheel(tmp_path)
    version = metadata.version("kiln-runtime")
    assert wheel.name == f"kiln_runtime-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = archive.read(f"kiln_runtime-{version}.dist-info/METADATA").decode()
    assert {"kiln/runtime/__init__.py", "kiln/runtime/archs.py", "kiln/runtime/loader.py",
            "kiln/runtime/spec.py"} <= names
    assert "kiln/__init__.py" not in names  # kiln is a namespace shared with Kiln itself
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert f"kiln_runtime-{version}.dist-info/RECORD" in names
    assert "Name: kiln-runtime" in meta and f"Version: {version}" in meta


def test_two_builds_are_byte_identical_so_republishing_is_a_no_op(tmp_path):
    first = build_runtime_wheel(tmp_path / "a").read_bytes()
    second = build_runtime_wheel(tmp_path / "b").read_bytes()
    assert first == second


def test_pip_installs_the_runtime_wheel_into_a_bare_venv_and_it_imports(tmp_path):
    wheel = build_runtime_wheel(tmp_path / "dist")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True,
                   timeout=TIMEOUT_S)
    python = tmp_path / "venv" / "bin" / "python"
    # This interpreter's pip installs into the bare venv: nothing of the test environment is visible there.
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                              "--no-deps", str(wheel)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run([str(python), "-c", "import kiln.runtime.archs, kiln.runtime.loader as m; print(m.__file__)"],
                           capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert str(tmp_path / "venv") in probe.stdout


def test_a_built_wheel_requires_exactly_the_kiln_runtime_published_beside_it():
    from pathlib import Path

    from kiln.tasks.project.config import load_config
    from kiln.tasks.wheel.assemble import requirements

    config = load_config(Path(__file__).parents[1] / "fixtures" / "projects" / "tiny" / "kiln.toml")
    assert config.project.ships_runtime
    requires = requirements(config, config.variants[0], {}, compiled=False)
    assert f"kiln-runtime=={metadata.version('kiln-runtime')}" in requires  # no other version, from no other index
    assert "kiln-runtime" not in requires
