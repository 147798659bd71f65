"""Kiln's installers take only wheels from an index: a build requirement published only as an sdist is refused
with the way out named, and its build hook never runs (it would have had the machine's network). One the project
names by file is built by Kiln first, without network, and the installer is given its wheel."""

from __future__ import annotations

import json

import pytest

from kiln.core import venvs
from kiln.core.errors import CompileError
from kiln.core.sandbox import support, wheels_only, wheels_only_hint
from kiln.tasks.build.guest_install import MAX_DEPTH, install_build_requirements, local_source, offline_wheels
from tests.helpers.hostile import Listener, helper_sdist


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


@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="this kernel allows no Landlock or no user namespaces: a build's network is not cut")
def test_a_build_requirement_named_by_file_is_built_without_network_and_its_wheel_installed(tmp_path):
    """A local sdist the project names is package code: Kiln builds it first with no network (its own build
    requirements from the index, wheels only), then gives the installer its wheel. Its hook, run twice (its
    requirements, its wheel), tries a listener on loopback and the files of the user and of this test."""
    listener = Listener()
    try:
        targets = {"read": [str(tmp_path)], "write": [str(tmp_path)], "listeners": [[listener.host, listener.port]]}
        sdist = helper_sdist(tmp_path / "helper-dist", targets)
        python = venvs.make_build_env(tmp_path / "env")
        install_build_requirements(python, [f"hostile-helper @ {sdist.as_uri()}"], "the fixture", 600)
    finally:
        listener.close()
    assert venvs.unmet_requirements(python, ["hostile-helper==0.1.0"]) == []
    site = venvs.site_packages(python)
    report = json.loads((site / "hostile_helper" / "install_probe.json").read_text())
    assert f"connect {listener.host}:{listener.port}" in report["tried"] and f"read {tmp_path}" in report["tried"]
    assert report["done"] == [], report
    assert listener.accepted == 0
    direct = json.loads((site / "hostile_helper-0.1.0.dist-info" / "direct_url.json").read_text())
    assert direct["url"].endswith(".whl"), direct  # the installer was given the wheel, never the sdist


def test_a_local_source_is_told_from_a_name_a_wheel_and_a_remote_url(tmp_path):
    sdist, folder, wheel = tmp_path / "a-1.0.tar.gz", tmp_path / "src", tmp_path / "a-1.0-py3-none-any.whl"
    sdist.write_bytes(b""), folder.mkdir(), wheel.write_bytes(b"")
    assert local_source(f"a @ {sdist.as_uri()}") == sdist
    assert local_source(f"a[x] @ {folder.as_uri()} ; python_version >= '3'") == folder
    assert local_source(str(folder)) == folder and local_source(sdist.as_uri()) == sdist
    assert local_source(f"a @ {wheel.as_uri()}") is None and local_source("a>=1") is None
    assert local_source("a @ https://example.org/a-1.0.tar.gz") is None
    assert local_source(f"a @ {(tmp_path / 'gone.tar.gz').as_uri()}") is None


def test_local_sources_nested_deeper_than_the_bound_are_refused_naming_the_requirement(tmp_path):
    sdist = tmp_path / "a-1.0.tar.gz"
    sdist.write_bytes(b"")
    with pytest.raises(CompileError, match=rf"'a @ {sdist.as_uri()}' is nested {MAX_DEPTH} deep"):
        offline_wheels([f"a @ {sdist.as_uri()}"], tmp_path / "python", tmp_path / "out", 10, depth=MAX_DEPTH)
    assert not (tmp_path / "out").exists()


def test_a_local_source_whose_marker_is_false_for_the_target_is_neither_built_nor_passed_on(tmp_path):
    """An empty "sdist" would fail any build: a requirement the target's marker rules out is skipped before that,
    as an installer skips it; one whose marker holds goes on to be built (and fails here, showing it was)."""
    sdist = tmp_path / "a-1.0.tar.gz"
    sdist.write_bytes(b"")
    python = venvs.create_env(tmp_path / "env")
    skipped = [f'a @ {sdist.as_uri()} ; python_version < "3"', f'a @ {sdist.as_uri()} ; sys_platform == "win32"']
    assert offline_wheels([*skipped, "numpy"], python, tmp_path / "out", 60) == ["numpy"]
    assert not (tmp_path / "out").exists()
    with pytest.raises(CompileError, match=rf"{sdist} is not an sdist Kiln can unpack"):
        offline_wheels([f'a @ {sdist.as_uri()} ; python_version >= "3"'], python, tmp_path / "out", 60)


def test_a_local_source_of_another_backend_gets_its_backend_before_its_hook_is_asked(tmp_path):
    """A local folder built by flit (not the setuptools the interpreter's ensurepip brings): its backend is
    installed first, then asked what else it needs, then it builds without network."""
    source = tmp_path / "flitpkg"
    (source / "flitpkg").mkdir(parents=True)
    (source / "flitpkg" / "__init__.py").write_text('"""A flit-built fixture."""\n__version__ = "0.2.0"\n')
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["flit_core>=3.4"]\nbuild-backend = "flit_core.buildapi"\n\n'
        '[project]\nname = "flitpkg"\nversion = "0.2.0"\ndescription = "fixture"\n')
    python = venvs.make_build_env(tmp_path / "env")
    install_build_requirements(python, [f"flitpkg @ {source.as_uri()}"], "the fixture", 600)
    assert venvs.unmet_requirements(python, ["flitpkg==0.2.0"]) == []


@pytest.mark.parametrize("requirement", ["helper @ https://example.org/helper-1.0.tar.gz",
                                         "helper @ git+https://example.org/helper.git@v1"])
def test_a_build_requirement_naming_a_remote_source_is_refused_before_any_installer_runs(tmp_path, requirement):
    with pytest.raises(CompileError, match="names a source by a remote URL"):
        offline_wheels([requirement], tmp_path / "python", tmp_path / "out", 10)
    assert offline_wheels(["w @ https://example.org/w-1.0-py3-none-any.whl"], tmp_path / "python", tmp_path, 10) == [
        "w @ https://example.org/w-1.0-py3-none-any.whl"]
