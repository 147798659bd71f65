"""The caller's own pip and uv configuration cannot shadow a Kiln index in a printed command (DESIGN invariant 12).

Real parts, as in :mod:`tests.release.test_supply_chain`: a real publish of ``kiln-kernels`` with
``kiln-runtime``; an honest extra index (``helper``, where PyPI stands); an attacker's index on loopback holding
same-version wheels of both held names with this interpreter's most specific tag and a ``.pth`` that writes a
marker whenever an interpreter starts. The caller's shell is hostile: ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS``,
a user ``pip.conf`` with ``find-links``, ``UV_EXTRA_INDEX_URL``, ``UV_INDEX``, ``UV_FIND_LINKS``, a
``UV_CONFIG_FILE`` and a user ``uv.toml`` with ``find-links``, all pointing at the attacker. Every printed
command is run in that shell with real pip and uv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.release.cli import index_command
from kiln.release.install.installer import pip_steps
from tests.helpers.wheelkit import make_wheel
from tests.release.test_supply_chain import TIMEOUT_S, attacker, installed, kiln_publish, printed_commands

pytestmark = pytest.mark.slow  # a dozen pip and uv runs

__all__ = ["attacker"]  # the fixture, imported for its use here


def honest_index(root: Path) -> str:
    make_wheel(root / "wheels", "helper", "1.0", payload="dependency")
    assert index_command(str(root / "wheels"), None, str(root / "simple")) == 0
    return (root / "simple").as_uri() + "/"


def hostile_home(home: Path, evil: str) -> dict[str, str]:
    """A home whose pip.conf and uv.toml add the attacker's pages, and the variables that do the same."""
    links = f"{evil}kiln-runtime/ {evil}kiln-kernels/"
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text(f"[global]\nfind-links = {links}\n")
    (home / ".config" / "uv").mkdir(parents=True)
    toml = "find-links = [" + ", ".join(f'"{link}"' for link in links.split()) + "]\n"
    (home / ".config" / "uv" / "uv.toml").write_text(toml)
    (home / "uv-config.toml").write_text(toml)
    return {"PIP_EXTRA_INDEX_URL": evil, "PIP_FIND_LINKS": f"{evil}kiln-runtime/", "UV_EXTRA_INDEX_URL": evil,
            "UV_INDEX": evil, "UV_FIND_LINKS": f"{evil}kiln-runtime/", "UV_CONFIG_FILE": str(home / "uv-config.toml")}


def run_in_shell(command: str, venv: Path, home: Path, hostile: dict[str, str]) -> None:
    """Run ``command`` as a user pastes it into a shell where ``venv`` is active and ``hostile`` is exported."""
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin",
           "VIRTUAL_ENV": str(venv), "HOME": str(home), "UV_NO_CACHE": "1", **hostile}
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=home)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=TIMEOUT_S)
    return path


def old_form(steps: list[list[str]]) -> str:
    """The command as Kiln printed it before it isolated each step from the caller's configuration."""
    return " && ".join(" ".join(["pip", "install", *step]) for step in steps)


def test_every_printed_command_installs_kilns_wheels_whatever_the_callers_pip_and_uv_configuration(tmp_path, attacker):
    """A nightly's commands (pip for the variant's index, uv for the combined one); a release's differ only in
    pinning, which test_supply_chain covers for both channels."""
    evil, markers = attacker
    home = tmp_path / "home"
    hostile = hostile_home(home, evil)
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    commands = printed_commands(run, plan, honest_index(tmp_path / "pypi"))
    for n, command in enumerate(commands):
        venv = fresh_venv(tmp_path / f"venv{n}")
        run_in_shell(command, venv, home, hostile)
        got = installed(venv, home)
        assert (got["kernels from"], got["runtime from"]) == ("kiln", "kiln"), (command, got)
    assert not markers.exists(), sorted(p.read_text() for p in markers.iterdir())
    # the premise: in that shell, the first step as Kiln printed it before takes the attacker's wheels
    pip = next(c for c in commands if " pip install " in c)
    url = pip.split("--index-url ", 1)[1].split()[0]
    venv = fresh_venv(tmp_path / "old")
    first = old_form(pip_steps(url, pip.split()[-1], ["kiln-runtime==0.1.0"], ["file:///nowhere/"])).split(" && ")[0]
    run_in_shell(first, venv, home, hostile)
    probe = "import kiln_k, kiln_rt; print(kiln_k.PAYLOAD, kiln_rt.PAYLOAD)"
    done = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=home)
    assert done.stdout.split() == ["attacker", "attacker"] and markers.exists(), (first, done.stdout, done.stderr)


def test_kiln_verify_hint_names_the_configured_index_that_would_shadow_the_old_form(tmp_path, attacker, monkeypatch,
                                                                                     capsys):
    evil, markers = attacker
    home = tmp_path / "home"
    hostile = hostile_home(home, evil)
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    honest = honest_index(tmp_path / "pypi")
    printed = next(c for c in printed_commands(run, plan, honest) if " pip install " in c)
    url = printed.split("--index-url ", 1)[1].split()[0]
    old = old_form(pip_steps(url, printed.split()[-1], ["kiln-runtime==0.1.0"], [honest]))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("PIP_CONFIG_FILE", raising=False)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.setenv(name, hostile[name])
    capsys.readouterr()

    assert main(["verify", url, "--no-install", "--hint", old]) != 0
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and f"install hint {old}: under your pip configuration, kiln-" in out, out
    conf = home / ".config" / "pip" / "pip.conf"
    for name in ("kiln-kernels", "kiln-runtime"):  # each held name, the file and the settings that offer it
        assert (f"{name} {'1.0.dev1+cpu' if name == 'kiln-kernels' else '0.1.0'} would come from {evil}{name}/"
                in out), out
        assert f"find-links in {conf} = {evil}{name}/" in out and f"PIP_EXTRA_INDEX_URL = {evil}" in out, out
    assert f"not from the Kiln index {url}" in out, out

    assert main(["verify", url, "--no-install", "--hint", printed]) == 0, capsys.readouterr().out
    assert f"install hint {printed}: ok" in capsys.readouterr().out
    assert not markers.exists(), sorted(p.read_text() for p in markers.iterdir())
