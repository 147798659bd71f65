"""The guest sandbox itself: what a process started through kiln.core.sandbox can read, write, reach and see."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.core.errors import KilnError
from kiln.core.sandbox import Policy, credential_name, guest_env, kiln_trees, support, wrap
from kiln.tasks.project.config import parse_config

PROBE = textwrap.dedent("""
    import json, os, socket, sys
    found = {}
    def attempt(name, action):
        try:
            action()
            found[name] = "ok"
        except OSError as exc:
            found[name] = type(exc).__name__
    attempt("read_canary", lambda: open(sys.argv[1]).read())
    attempt("list_canary_dir", lambda: os.listdir(os.path.dirname(sys.argv[1])))
    attempt("write_outside", lambda: open(sys.argv[2], "w").write("x"))
    attempt("write_work", lambda: open(os.path.join(sys.argv[3], "mine"), "w").write("x"))
    attempt("host_listener", lambda: socket.create_connection(("127.0.0.1", int(sys.argv[4])), timeout=5).close())
    def own_loopback():
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            socket.create_connection(server.getsockname(), timeout=5).close()
    attempt("own_loopback", own_loopback)
    attempt("parent_environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
    found["env"] = sorted(os.environ)
    print(json.dumps(found))
""")

needs_sandbox = pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                                   reason="this kernel allows no Landlock or no user namespaces")


@pytest.mark.parametrize(("name", "credential"), [
    ("AWS_SECRET_ACCESS_KEY", True), ("PREFECT_API_KEY", True), ("PREFECT_HOME", True),
    ("ACTIONS_ID_TOKEN_REQUEST_TOKEN", True), ("ACTIONS_ID_TOKEN_REQUEST_URL", True), ("TWINE_PASSWORD", True),
    ("GITHUB_TOKEN", True), ("PYPI_ID_TOKEN", True), ("SIGSTORE_ID_TOKEN", True), ("HF_TOKEN", True),
    ("MY_SERVICE_SECRET", True), ("CUDA_VISIBLE_DEVICES", False), ("TOKENIZERS_PARALLELISM", False),
    ("PATH", False), ("MY_FIXTURE_DIR", False),
])
def test_credential_names_are_recognised_by_name(name, credential):
    assert credential_name(name) is credential


def test_a_guest_environment_keeps_the_allow_list_what_kiln_set_and_pass_env_never_a_credential(tmp_path):
    inherited = {"PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "s", "GITHUB_TOKEN": "t", "SOMETHING_ELSE": "x",
                 "PASSED": "p", "XDG_CONFIG_HOME": "/home/u/.config", "HOME": "/home/u"}
    env = guest_env({**inherited, "KILN_VARIANT": "cpu", "TWINE_PASSWORD": "set by mistake"}, tmp_path / "home",
                    pass_env=["PASSED"], inherited=inherited)
    assert env["PATH"] == "/usr/bin" and env["KILN_VARIANT"] == "cpu" and env["PASSED"] == "p"
    assert env["HOME"] == str(tmp_path / "home") and Path(env["TMPDIR"]).is_dir()
    for dropped in ("AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "SOMETHING_ELSE", "XDG_CONFIG_HOME", "TWINE_PASSWORD"):
        assert dropped not in env


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "PREFECT_API_KEY", "ACTIONS_ID_TOKEN_REQUEST_TOKEN"])
def test_pass_env_naming_a_credential_is_refused_naming_it(name, tmp_path):
    base = {"project": {"package": "p", "distribution": "p", "version": "1.0"},
            "variants": [{"name": "cpu", "backend": "cpu"}]}
    with pytest.raises(KilnError, match=f"pass_env: '{name}' names a credential"):
        parse_config({**base, "build": {"pass_env": [name]}}, tmp_path)
    with pytest.raises(KilnError, match=f"pass_env: '{name}' names a credential"):
        parse_config({**base, "suites": [{"name": "unit", "paths": ["tests"], "pass_env": [name]}]}, tmp_path)


def _probe(tmp_path: Path, network: str) -> dict:
    home = tmp_path / "someones-home"
    home.mkdir(exist_ok=True)
    canary = home / "credentials"
    canary.write_text("secret")
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        cmd = [sys.executable, "-c", PROBE, str(canary), str(tmp_path / "outside"), str(work),
               str(listener.getsockname()[1])]
        policy = Policy(read=tuple(sorted(kiln_trees())), write=(str(work),), network=network)  # type: ignore[arg-type]
        env = guest_env({**os.environ, "AWS_SECRET_ACCESS_KEY": "s3cr3t"}, work / "home")
        done = subprocess.run(wrap(cmd, policy), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_sandbox
@pytest.mark.parametrize("network", ["none", "loopback"])
def test_a_guest_reads_no_other_tree_writes_only_its_work_and_reaches_no_host_listener(tmp_path, network):
    found = _probe(tmp_path, network)
    assert found["read_canary"] == "PermissionError" and found["list_canary_dir"] == "PermissionError"
    assert found["write_outside"] == "PermissionError" and not (tmp_path / "outside").exists()
    assert found["write_work"] == "ok"
    assert found["host_listener"] != "ok"
    assert found["parent_environ"] == "PermissionError"  # the step's secrets are not read through /proc
    assert "AWS_SECRET_ACCESS_KEY" not in found["env"]
    # a build has no network at all; a test or benchmark has a loopback of its own
    assert found["own_loopback"] == ("ok" if network == "loopback" else "OSError")


def test_the_launcher_refuses_a_malformed_command_line():
    done = subprocess.run([sys.executable, "-I", "-m", "kiln.core.sandbox", "{}"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


SEALED = textwrap.dedent("""
    import ctypes, os, subprocess, sys
    if sys.argv[1] == "seal":  # what kiln.core.sandbox.seal_environ does (this interpreter may not import Kiln)
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    reader = "import os, sys\\ntry:\\n    open(f'/proc/{os.getppid()}/environ', 'rb').read()\\n    print('read')\\n" \\
             "except OSError as exc:\\n    print(type(exc).__name__)"
    print(subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60).stdout.strip())
""")


def test_seal_environ_makes_kilns_process_non_dumpable():
    code = ("import ctypes; from kiln.core.sandbox import seal_environ; libc = ctypes.CDLL(None)\n"
            "before = libc.prctl(3, 0, 0, 0, 0); seal_environ(); print(before, libc.prctl(3, 0, 0, 0, 0))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1", "0"], done.stderr


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="the system's python3 runs the pair as nobody")
@pytest.mark.parametrize(("mode", "expected"), [("seal", "PermissionError"), ("open", "read")])
def test_a_sealed_process_environment_is_unreadable_to_another_process_of_its_user(mode, expected):
    """What Kiln's command does first: code it runs outside the sandbox (an installer's sdist build) cannot
    read the step's credentials from /proc. Root reads everything, so as root the pair runs as nobody."""
    demote = (lambda: (os.setgid(65534), os.setuid(65534))) if os.geteuid() == 0 else None
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", SEALED, mode], capture_output=True, text=True,
                          timeout=120, preexec_fn=demote, cwd="/")
    assert done.stdout.strip() == expected, done.stderr
