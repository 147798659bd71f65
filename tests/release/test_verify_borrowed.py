"""``kiln verify URL`` without an extra index (issue 46): what the index holds of a wheel's dependencies is installed
from it, and what the wheel borrows from this interpreter loads however that was installed (editable included).

Real parts: the ``kiln-runtime`` wheel the publish stage builds, ``kiln index`` pages, pip and uv into fresh
venvs. In the README's set-up Kiln and ``kiln-runtime`` are editable installs (a setuptools ``__editable__``
finder that only a ``.pth`` file starts), which is what this test's interpreter runs.
"""

from __future__ import annotations

from importlib import metadata

import pytest

from kiln.flows.cli import main
from kiln.release.cli import index_command
from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel
from tests.helpers.wheelkit import make_wheel

pytestmark = pytest.mark.slow  # six venvs, pip and uv


def test_verify_without_an_extra_index_installs_held_dependencies_and_sees_editable_installs(tmp_path, capsys):
    wheels = tmp_path / "wheels"
    build_runtime_wheel(wheels)
    runtime = metadata.version("kiln-runtime")
    # imports kiln.runtime, which only the index's kiln-runtime wheel gives the fresh venv
    make_wheel(wheels, "kiln-kernels", "1.0.dev1+cpu", module="kiln_k", requires=[f"kiln-runtime=={runtime}"],
               body="import kiln.runtime.spec\n")
    # imports what it borrows from this interpreter: Kiln itself (editable in the README's set-up), and packaging
    make_wheel(wheels, "borrower", "1.0", body="import kiln.core.errors\nimport packaging.version\n")
    assert index_command(str(wheels), None, str(tmp_path / "index")) == 0
    capsys.readouterr()
    assert main(["verify", (tmp_path / "index").as_uri() + "/"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for tool in ("pip", "uv"):
        assert f"install {tool} kiln-kernels==1.0.dev1+cpu: ok" in out and f"install {tool} borrower==1.0: ok" in out
