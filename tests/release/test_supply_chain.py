"""Dependency confusion and sdist hooks, as an attacker would run them (issue 40, DESIGN invariant 12).

Real parts: an index from a real publish (:func:`kiln.release.publish.protocol.publish`: a ``kiln-kernels`` nightly or
release wheel requiring ``kiln-runtime==0.1.0`` and ``helper``, ``kiln-runtime`` beside it, each variant's and
the combined index); an attacker's index (``kiln index`` pages) served by ``http.server`` on loopback holding
``helper`` (it stands where PyPI stands), ``kiln-runtime 99.0``, a ``kiln-runtime 0.1.0`` wheel with this
interpreter's most specific tag, and ``kiln-kernels`` higher and same-version-more-specific; each attacker
wheel carries a ``.pth`` that writes a marker at every interpreter start. Every command the run prints is
run with real pip and uv into fresh venvs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.tags import sys_tags

from kiln.core.installenv import run_installer, scrubbed_env
from kiln.core.manifest import RunManifest
from kiln.core.store import LocalStore
from kiln.core.wheels import read_wheel
from kiln.flows.cli import main
from kiln.flows.report.summary import render_text
from kiln.release.cli import index_command
from kiln.release.publish.closure import ClosureQuery, Staged, resolve
from kiln.release.publish.plan import Plan
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.tasks.install_hint import install_facts
from tests.helpers.runkit import variant_document
from tests.helpers.sdists import evil_sdist_index
from tests.helpers.staticserver import static_server
from tests.helpers.wheelkit import make_wheel

pytestmark = pytest.mark.slow  # a few dozen pip and uv runs

NIGHTLY, RELEASE, RUNTIME = "1.0.dev1", "1.0", "0.1.0"
REQUIRES = [f"kiln-runtime=={RUNTIME}", "helper"]
TIMEOUT_S = 300


def _marker_pth(markers: Path) -> dict[str, bytes]:
    line = (f"import os, pathlib; pathlib.Path({str(markers)!r}).mkdir(exist_ok=True); "
            f"pathlib.Path({str(markers)!r}, str(os.getpid())).write_text('attacker code ran')\n")
    return {"zz_attacker.pth": line.encode()}


def attacker_index(root: Path, markers: Path) -> Path:
    """The attacker's wheels as ``kiln index`` pages under ``root/simple``."""
    wheels, pth = root / "wheels", _marker_pth(markers)
    specific = str(next(iter(sys_tags())))  # what this pip ranks above py3-none-any
    make_wheel(wheels, "helper", "1.0", payload="dependency")  # the honest dependency, as PyPI holds it
    make_wheel(wheels, "kiln-runtime", "99.0", module="kiln_rt", payload="attacker", files=pth)
    make_wheel(wheels, "kiln-runtime", RUNTIME, module="kiln_rt", payload="attacker", tag=specific, files=pth)
    make_wheel(wheels, "kiln-kernels", "99.0", module="kiln_k", payload="attacker", files=pth,
               requires=["kiln-runtime", "helper"])
    for version in (f"{NIGHTLY}+cpu", RELEASE, NIGHTLY):
        make_wheel(wheels, "kiln-kernels", version, module="kiln_k", payload="attacker", tag=specific, files=pth,
                   requires=["kiln-runtime", "helper"])
    assert index_command(str(wheels), None, str(root / "simple")) == 0
    return root / "simple"


def kiln_publish(root: Path, channel: str) -> tuple[RunManifest, Plan]:
    """A real publish of kiln-kernels (cpu variant, and the combined index of variant wheels) with kiln-runtime."""
    version = NIGHTLY if channel == "nightly" else RELEASE
    run = RunManifest(root / "run", "r1", flow=channel, version=version)
    wheels = root / "run" / "wheels"
    local = make_wheel(wheels / "cpu", "kiln-kernels", f"{version}+cpu", module="kiln_k", payload="kiln",
                       requires=REQUIRES)
    run.add_artifact(local, step="build", kind="wheel", variant="cpu")
    for label in ("null", None):
        variant = make_wheel(wheels / "variants", "kiln-kernels", version, module="kiln_k", payload="kiln",
                             requires=REQUIRES, label=label,
                             variant_json=variant_document("null", {}) if label else None)
        run.add_artifact(variant, step="build", kind="variant-wheel", variant="cpu")
    runtime = make_wheel(root / "runtime", "kiln-runtime", RUNTIME, module="kiln_rt", payload="kiln")
    plan = publish(run, LocalStore(root / "index"),
                   PublishRequest(channel=channel, channel_prefix=channel, variants=["cpu"], extra=[(None, runtime)],
                                  commit="ab" * 20 if channel == "nightly" else ""),
                   PublishSteps(clock=lambda: 1e9))
    return run, plan


def printed_commands(run: RunManifest, plan: Plan, extra: str) -> list[str]:
    """Every install command the run's summary prints, with ``extra`` as the project's extra index."""
    run.info["install"] = install_facts("kiln-kernels", [extra], plan, check=False)
    run.info["index_url"] = sorted(run.info["install"]["indexes"])
    lines = [line.strip().removeprefix("install: ") for line in render_text(run).splitlines()
             if line.strip().startswith("install: ")]
    assert len(lines) == len(run.info["index_url"]) >= 2, render_text(run)
    return lines


def run_printed(command: str, venv: Path, home: Path) -> None:
    """Run ``command`` as a user would in a shell where ``venv`` is active."""
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv), "HOME": str(home),
           "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "UV_NO_CACHE": "1"}
    for step in command.split(" && "):
        argv = shlex.split(step)
        assert argv[0] == "env" and argv[argv.index("install") - 1] in ("pip", "uv"), command
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=home)
        assert done.returncode == 0, f"{step}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def installed(venv: Path, home: Path) -> dict[str, str]:
    """What the venv holds of kiln-kernels and kiln-runtime: versions, and whose files (the module's PAYLOAD)."""
    probe = ("import importlib.metadata as m, kiln_k, kiln_rt, helper; "
             "print(m.version('kiln-kernels'), kiln_k.PAYLOAD, m.version('kiln-runtime'), kiln_rt.PAYLOAD)")
    done = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=home)
    assert done.returncode == 0, done.stderr
    kernels, kernels_payload, runtime, runtime_payload = done.stdout.split()
    return {"kiln-kernels": kernels, "kernels from": kernels_payload, "kiln-runtime": runtime,
            "runtime from": runtime_payload}


@pytest.fixture
def attacker(tmp_path: Path):
    markers = tmp_path / "markers"
    with static_server(attacker_index(tmp_path / "attacker", markers).parent) as url:
        yield url + "simple/", markers


@pytest.mark.parametrize("channel", ["nightly", "release"])
def test_every_printed_command_installs_kilns_files_only_and_no_attacker_code_runs(tmp_path, attacker, channel):
    extra, markers = attacker
    run, plan = kiln_publish(tmp_path / "kiln", channel)
    commands = printed_commands(run, plan, extra)
    assert {next(w for w in c.split() if w in ("pip", "uv")) for c in commands} == {"pip", "uv"}, commands
    for n, command in enumerate(commands):
        venv, home = tmp_path / f"venv{n}", tmp_path / f"home{n}"
        home.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT_S)
        run_printed(command, venv, home)
        got = installed(venv, home)
        assert got["kernels from"] == "kiln" and got["runtime from"] == "kiln", (command, got)
        assert got["kiln-runtime"] == RUNTIME, (command, got)
    assert not markers.exists(), sorted(p.read_text() for p in markers.iterdir())
    # the premise: one pip command naming both indexes takes the attacker's files and runs their code
    one = next(c for c in commands if c.startswith("env PIP_CONFIG_FILE")).split(" && ")[1]
    venv, home = tmp_path / "naive", tmp_path / "naive-home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT_S)
    run_printed(one, venv, home)
    got = installed(venv, home)
    assert (got["kernels from"], got["runtime from"]) == ("attacker", "attacker") and markers.exists(), got


def _cpu_url(plan: Plan, channel: str) -> str:
    return f"{plan.target}/{channel}/cpu/simple/"


def test_the_dependency_check_refuses_a_held_name_from_the_attackers_index_naming_file_and_index(tmp_path,
                                                                                                 attacker):
    extra, markers = attacker
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    wheel = run.root / run.artifacts_of("wheel")[0].path
    runtime = next((tmp_path / "kiln" / "runtime").glob("*.whl"))
    query = ClosureQuery("cpu", Staged(read_wheel(wheel)[0], wheel), (Staged(read_wheel(runtime)[0], runtime),),
                         (extra,))
    result = resolve(query)
    assert not result.ok
    text = result.describe(query)
    assert "would not install: another index shadows a name the Kiln index holds" in text, text
    assert f"kiln-runtime 99.0 would come from {extra}kiln-runtime/" in text and f"({extra})" in text, text
    assert not markers.exists()


def test_kiln_verify_and_its_hint_refuse_the_attackers_index_as_an_extra_index(tmp_path, attacker, capsys):
    extra, markers = attacker
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    url = _cpu_url(plan, "nightly")
    printed = next(c for c in printed_commands(run, plan, extra) if c.startswith(f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} "))
    naive = printed.split(" && ")[1]  # one pip command naming both indexes, as Kiln printed before
    attack = f"kiln-runtime 99.0 would come from {extra}kiln-runtime/kiln_runtime-99.0-py3-none-any.whl ({extra})"

    assert main(["verify", url, "--extra-index-url", extra, "--hint", printed]) != 0
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and attack in out and f"not from the Kiln index {url}" in out, out

    assert main(["verify", url, "--no-install", "--hint", naive]) != 0  # refused before it runs
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and attack in out, out

    assert main(["verify", url, "--no-install", "--hint", printed]) == 0, capsys.readouterr().out
    assert f"install hint {printed}: ok" in capsys.readouterr().out
    assert not markers.exists(), sorted(p.read_text() for p in markers.iterdir())


def test_an_sdist_only_dependency_is_reported_and_its_build_hook_never_runs(tmp_path, monkeypatch, capsys):
    markers = tmp_path / "markers"
    evil = evil_sdist_index(tmp_path / "evil", markers)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "publish-step-secret")
    monkeypatch.setenv("PREFECT_API_KEY", "prefect-secret")
    wheel = make_wheel(tmp_path / "run", "kiln-kernels", f"{NIGHTLY}+cpu", module="kiln_k", requires=["evil-sdist"])
    query = ClosureQuery("cpu", Staged(read_wheel(wheel)[0], wheel), (), (evil,))
    result = resolve(query)
    assert not result.ok and "evil-sdist" in result.missing and "only an sdist" in result.missing, result
    assert index_command(str(wheel.parent), None, str(tmp_path / "kiln")) == 0
    assert main(["verify", (tmp_path / "kiln").as_uri() + "/", "--extra-index-url", evil]) != 0
    out = capsys.readouterr().out
    assert "the indexes hold only an sdist of evil-sdist (not built: wheels only)" in out, out
    assert not markers.exists()
    # the premise, and the scrub: pip left to itself builds the sdist; even then the hook sees no secret
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run_installer([sys.executable, "-I", "-m", "pip", "install", "--dry-run", "--isolated", "--no-cache-dir",
                   "--index-url", evil, "evil-sdist"], cwd, TIMEOUT_S)
    seen = [json.loads(p.read_text()) for p in markers.iterdir()]
    assert seen and all("AWS_SECRET_ACCESS_KEY" not in env and "PREFECT_API_KEY" not in env for env in seen)
    assert all(env["HOME"] != os.environ.get("HOME") for env in seen)


def test_the_installer_environment_keeps_what_reaches_an_index_and_drops_every_secret(tmp_path):
    source = {"PATH": "/usr/bin", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "s", "AWS_PROFILE": "p",
              "GOOGLE_APPLICATION_CREDENTIALS": "/g.json", "PREFECT_API_KEY": "k", "PREFECT_HOME": "/p",
              "KILN_ARTIFACTS": "s3://b", "HTTPS_PROXY": "http://proxy:3128", "PIP_INDEX_URL": "https://mirror/simple",
              "UV_INDEX_URL": "https://mirror/simple", "SSL_CERT_FILE": "/etc/ca.pem", "LC_ALL": "C.UTF-8",
              "UV_PUBLISH_TOKEN": "t", "GITHUB_TOKEN": "g", "PIP_EXTRA_INDEX_URL": "http://evil/simple",
              "UV_INDEX_STRATEGY": "unsafe-best-match", "PIP_CERT": "/etc/ca.pem"}
    env = scrubbed_env(tmp_path, source)
    assert env["HOME"] == str(tmp_path)
    assert {k: env[k] for k in ("PATH", "HTTPS_PROXY", "PIP_INDEX_URL", "UV_INDEX_URL", "SSL_CERT_FILE", "LC_ALL")} \
        == {k: source[k] for k in ("PATH", "HTTPS_PROXY", "PIP_INDEX_URL", "UV_INDEX_URL", "SSL_CERT_FILE", "LC_ALL")}
    assert not {"AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS", "PREFECT_API_KEY",
                "PREFECT_HOME", "KILN_ARTIFACTS", "UV_PUBLISH_TOKEN", "GITHUB_TOKEN", "PIP_EXTRA_INDEX_URL",
                "UV_INDEX_STRATEGY"} & set(env)
    assert env["PIP_CERT"] == "/etc/ca.pem"


def test_kiln_verify_resolves_dependencies_from_an_honest_extra_index_and_held_names_from_kiln(tmp_path, capsys):
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    make_wheel(tmp_path / "pypi-wheels", "helper", "1.0", payload="dependency")
    assert index_command(str(tmp_path / "pypi-wheels"), None, str(tmp_path / "pypi")) == 0
    honest = (tmp_path / "pypi").as_uri() + "/"
    url = _cpu_url(plan, "nightly")
    capsys.readouterr()
    assert main(["verify", url, "--extra-index-url", honest]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for tool in ("pip", "uv"):  # pip in two steps, uv with its first index: kiln-runtime from Kiln, helper from "PyPI"
        assert f"install {tool} kiln-kernels=={NIGHTLY}+cpu: ok" in out, out


def test_kiln_verify_runs_the_printed_uv_hint_and_refuses_one_that_ranks_the_attackers_index_first(tmp_path, attacker,
                                                                                                    capsys):
    extra, markers = attacker
    run, plan = kiln_publish(tmp_path / "kiln", "nightly")
    printed = next(c for c in printed_commands(run, plan, extra) if " uv pip install " in c)
    url = next(printed.split()[i + 1] for i, word in enumerate(printed.split()) if word == "--index")
    capsys.readouterr()

    assert main(["verify", url, "--no-install", "--hint", printed]) == 0, capsys.readouterr().out
    assert f"install hint {printed}: ok" in capsys.readouterr().out

    # the same command with the attacker's index ranked first: uv's first-index strategy then takes every name
    # the attacker holds from the attacker; the lock shows it before anything is installed
    words = printed.split()
    at = words.index("--index")
    ranked = shlex.join([*words[:at], "--index", extra, *words[at:]])
    assert main(["verify", url, "--no-install", "--hint", ranked]) != 0
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and f"would come from {extra}kiln-runtime/" in out, out
    assert f"not from the Kiln index {url}" in out, out
    assert not markers.exists(), sorted(p.read_text() for p in markers.iterdir())
