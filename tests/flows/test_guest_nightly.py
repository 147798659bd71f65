"""A hostile package through a real nightly, with the step's secrets set: its build (setup.py), its conftest
and its tests each try to read the credentials, the CI identity, the user's home, Kiln's Prefect home and
store, to write Kiln's state and the shared test base, and to reach a listener outside their sandbox. Nothing
succeeds, and what the suite legitimately needs (a pass_env variable, its own loopback) still works."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.sandbox import CONFINEMENT_INFO, support
from tests.helpers.gitrepo import FIXTURES, init_repo
from tests.helpers.hostile import SECRETS, Listener, own_address


@pytest.mark.slow
@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="this kernel allows no Landlock or no user namespaces: package code is not confined")
def test_a_hostile_packages_build_conftest_and_tests_reach_no_secret_home_store_base_or_listener(
        prefect_server, tmp_path, monkeypatch):
    from kiln.flows.nightly import nightly_flow

    repo = tmp_path / "hostile"
    shutil.copytree(FIXTURES / "hostile", repo, ignore=shutil.ignore_patterns("__pycache__"))
    init_repo(repo)
    out = tmp_path / "out"
    out.mkdir()
    canary = tmp_path / "credentials"  # a credential file of the user's, outside every tree a guest is given
    canary.write_text("[default]\naws_secret_access_key = canary\n")
    # one on the host's loopback, one on its own network's address (a namespace's own loopback reaches neither)
    listeners = [Listener(), Listener(own_address())]
    for listener in listeners:  # the direct check: each answers a process outside the sandbox
        socket.create_connection((listener.host, listener.port), timeout=5).close()
    targets = {"read": [str(canary), str(Path.home()), str(out), os.environ.get("PREFECT_HOME", str(Path.home()))],
               "write": [str(out), str(repo), str(repo / ".kiln"), str(tmp_path)],
               "listeners": [[listener.host, listener.port] for listener in listeners]}
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOSTILE_TARGETS", json.dumps(targets))
    monkeypatch.setenv("HOSTILE_ALLOWED", "yes")
    try:
        state = nightly_flow(config_path=str(repo / "kiln.toml"), out=str(out), return_state=True)
    finally:
        for listener in listeners:
            listener.close()
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    assert units["test/unit/cpu"].state == "completed", units["test/unit/cpu"].message
    assert units["test/unit/cpu"].message.startswith("3 passed"), units["test/unit/cpu"].message
    [wheel] = [run.root / a.path for a in run.artifacts_of("wheel")]
    with zipfile.ZipFile(wheel) as archive:
        built = json.loads(archive.read("hostile/build_probe.json"))
    assert len(built["tried"]) > 5 and built["done"] == [], built  # the build reached nothing either
    assert {f"connect {listener.host}:{listener.port}" for listener in listeners} <= set(built["tried"])
    assert [listener.accepted for listener in listeners] == [1, 1]  # only the direct checks above
    assert not list(out.glob(".hostile-*")) and not list(repo.glob(".hostile-*"))
    assert state.is_completed(), state.message
    # each step that ran the package's code recorded how this machine confined it
    confined = {k.removeprefix(CONFINEMENT_INFO).split("@")[0]: v for k, v in run.info.items()
                if k.startswith(CONFINEMENT_INFO)}
    assert {k: (v["network"], v["gaps"], v["landlock_abi"] > 0, v["namespaces"]) for k, v in confined.items()} == {
        "build": ("none", [], True, True), "test": ("loopback", [], True, True), "bench": ("loopback", [], True, True)}


@pytest.mark.slow
@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="this kernel allows no Landlock or no user namespaces: package code is not confined")
def test_a_whole_nightly_of_a_nosy_registry_never_imports_it_here_and_its_import_reaches_nothing(
        prefect_server, tmp_path, monkeypatch):
    """The nosy fixture's registry tries, at import, to read the step's secrets, plant a file in the project and
    reach a listener. A whole in-process nightly (so this process is Kiln's) plans, builds and publishes its
    kernel, and the package is never imported here: nothing is planted, nothing reached."""
    from kiln.flows.nightly import nightly_flow

    for name in [m for m in sys.modules if m == "nosy" or m.startswith("nosy.")]:  # another test's own import
        monkeypatch.delitem(sys.modules, name)
    repo = tmp_path / "nosy"
    shutil.copytree(FIXTURES / "nosy", repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / ".gitignore").write_text("port\nplanted\n")
    init_repo(repo)
    listener = Listener()
    (repo / "port").write_text(str(listener.port))
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    try:
        state = nightly_flow(config_path=str(repo / "kiln.toml"), out=str(tmp_path / "out"), return_state=True)
    finally:
        listener.close()
    assert state.is_completed(), state.message
    run = RunManifest.load(tmp_path / "out" / str(state.state_details.flow_run_id))
    assert {u.id: u.state for u in run.units if u.stage == "build"} == {
        "build/cu130/8.0/copy/fp32_b64": "completed", "build/cu130/wheel": "completed"}
    assert [a.variant for a in run.artifacts_of("wheel")] == ["cu130"]
    assert not [m for m in sys.modules if m == "nosy" or m.startswith("nosy.")], "the package ran in Kiln's process"
    assert not (repo / "planted").exists() and listener.accepted == 0
