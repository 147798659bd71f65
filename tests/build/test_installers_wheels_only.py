"""Kiln's installers take only wheels from an index: a build requirement published only as an sdist is refused
with the way out named, and its build hook never runs (it would have had the machine's network)."""

from __future__ import annotations

import pytest

from kiln.core import venvs
from kiln.core.errors import CompileError
from kiln.core.sandbox import support, wheels_only, wheels_only_hint
from kiln.tasks.build.buildenv import install_build_requirements
from tests.helpers.hostile import helper_sdist


def test_pip_and_uv_installs_take_only_wheels_and_other_commands_run_as_they_came():
    assert wheels_only(["py", "-P", "-m", "pip", "install", "--quiet", "x"]) == [
        "py", "-P", "-m", "pip", "install", "--only-binary", ":all:", "--quiet", "x"]
    assert wheels_only(["uv", "pip", "install", "--python", "p", "x"]) == [
        "uv", "pip", "install", "--only-binary", ":all:", "--python", "p", "x"]
    assert wheels_only(["uv", "venv", "x"]) == ["uv", "venv", "x"]
    assert wheels_only(["py", "-m", "pip", "wheel", "install"]) == ["py", "-m", "pip", "wheel", "install"]


def test_the_way_out_is_said_only_where_an_installer_found_no_wheel_it_may_take():
    assert "find-links" in wheels_only_hint("ERROR: No matching distribution found for x==1")
    assert "find-links" in wheels_only_hint("because x==1 has no usable wheels and only x==1 is available")
    assert wheels_only_hint("ERROR: Cannot install a==1 and b==2 because these package versions conflict") == ""


@pytest.mark.skipif(not support().landlock_abi, reason="this kernel has no Landlock: installers are not confined")
def test_a_build_requirement_an_index_holds_only_as_an_sdist_is_refused_and_never_built(tmp_path, monkeypatch):
    links = tmp_path / "links"
    helper_sdist(links)  # hostile-helper 0.1.0: its hook probes, and it would be installed if built
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    python = venvs.make_build_env(tmp_path / "env")
    with pytest.raises(CompileError) as info:
        install_build_requirements(python, ["hostile-helper==0.1.0"], "the fixture", 300)
    message = str(info.value)
    assert "No matching distribution found for hostile-helper==0.1.0" in message  # pip's own refusal
    assert "only wheels from an index" in message and "find-links" in message
    assert venvs.unmet_requirements(python, ["hostile-helper==0.1.0"]) != []
