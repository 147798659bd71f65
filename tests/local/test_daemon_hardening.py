"""Kiln's daemon under hostile or unusual conditions (issue 33 items 6 and 10, issue 27 item 2).

Real processes throughout (tests/helpers/daemons.py): daemons started as ``kiln`` starts them, in
a state directory of their own, and clients that are Python processes of their own. The daemon
runs tests/helpers/daemon_entry.py where a test checks what the command's process sees, and
``kiln`` itself where a test checks real commands.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.flows.local import daemon, server
from kiln.flows.local.daemon_server import running
from tests.helpers.daemons import NOT_SERVED, REPO, client, daemon_env, key_of, start_daemon, state_directory
from tests.helpers.projects import copy_project
from tests.helpers.waiting import until

ENTRY = "tests.helpers.daemon_entry:main"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    with daemon_env() as values:
        yield values


@pytest.fixture
def entry_env(env: dict[str, str]) -> dict[str, str]:
    """For a daemon that runs tests/helpers/daemon_entry.py (importable from the checkout's root)."""
    return {**env, "PYTHONPATH": str(REPO)}


def _serving(env: dict[str, str]) -> tuple[int, Path]:
    """The one daemon of ``env``'s state directory, once it serves: its pid and log."""
    directory = state_directory(env)
    found = until(lambda: running(directory), bool, 180)
    assert len(found) == 1, [p.read_text() for p in directory.glob("*.log")]
    (key, pid), = found
    sock, _, log = daemon.paths_for(key, directory)
    assert until(sock.exists, bool, 300), log.read_text()
    return pid, log


def test_a_module_planted_in_the_commands_directory_is_never_imported_by_the_daemon(env, tmp_path):
    shared, markers = tmp_path / "shared", tmp_path / "markers"
    shared.mkdir()
    markers.mkdir()
    plant = f"import pathlib\npathlib.Path({str(markers)!r}, __name__).write_text('imported')\n"
    for name in ("json.py", "typing_extensions.py", "prefect.py"):  # stdlib, a dependency, Prefect
        (shared / name).write_text(plant)
    (shared / "kiln").mkdir()  # Kiln's own import name
    (shared / "kiln" / "__init__.py").write_text(plant)
    first = client(env, shared, "build")  # no daemon yet: starts one from this directory as it exits
    first.communicate(timeout=120)
    assert first.returncode == NOT_SERVED
    pid, log = _serving(env)
    second = client(env, shared, "daemon", "status")  # a child of the daemon, working in `shared`
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert f"running: pid {pid}" in out and f"kiln daemon {pid}: command pid" in log.read_text()
    assert sorted(p.name for p in markers.iterdir()) == []


def test_the_command_takes_the_callers_umask_and_resource_limits(entry_env):
    start_daemon(entry_env, REPO, ENTRY)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    prelude = ("import os, resource\nos.umask(0o077)\n"
               f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))\n"
               "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n")
    proc = client(entry_env, REPO, "limits", prelude=prelude)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err  # not NOT_SERVED: the daemon ran it
    seen = json.loads(out)
    assert seen["umask"] == 0o077
    assert seen["RLIMIT_NOFILE"] == [256, hard] and seen["RLIMIT_CORE"] == [0, 0]
    plain = client(entry_env, REPO, "limits")  # the next command is not left with the last one's
    out, err = plain.communicate(timeout=120)
    assert plain.returncode == 0, err
    assert json.loads(out)["RLIMIT_NOFILE"] == list(resource.getrlimit(resource.RLIMIT_NOFILE))
    assert json.loads(out)["umask"] == _umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _good(key: str) -> dict:
    return {"key": key, "argv": ["kiln", "echo", "0"], "cwd": str(REPO), "env": {}, "umask": 0o022, "rlimits": {}}


def _malformed(key: str) -> list[bytes]:
    good = _good(key)
    wrong = [{"argv": "kiln echo 0"}, {"argv": []}, {"argv": ["kiln", 7]}, {"cwd": "relative"}, {"cwd": None},
             {"env": ["A=1"]}, {"env": {"A": 1}}, {"env": {"A=B": "1"}}, {"env": {"A": "\0"}}, {"umask": "022"},
             {"umask": 0o7777}, {"umask": True}, {"rlimits": {"RLIMIT_NOFILE": [1]}},
             {"rlimits": {"RLIMIT_BOGUS": [1, 1]}}, {"rlimits": {"RLIMIT_NOFILE": [1.5, 2]}}, {"key": 3}]
    truncated = json.dumps(good).encode()[:40]
    return [b"\xff\xfe\x00 garbage", truncated, b"[" * 100_000, b"[]", b"null", json.dumps({"key": key}).encode(),
            *(json.dumps({**good, **change}).encode() for change in wrong)]


def _ask(sock_path: Path, payload: bytes, fds: list[int]) -> dict | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(60)
        conn.connect(str(sock_path))
        if fds:
            socket.send_fds(conn, [payload], fds)
        else:
            conn.send(payload)
        return daemon.receive(conn)


def test_a_malformed_request_is_refused_and_the_daemon_keeps_serving(entry_env):
    pid, log = start_daemon(entry_env, REPO, ENTRY)
    key = key_of(entry_env, REPO)
    sock_path = daemon.paths_for(key, state_directory(entry_env))[0]
    payloads = _malformed(key)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        answers = [_ask(sock_path, payload, [null] * 3) for payload in payloads]
        without_stdio = _ask(sock_path, json.dumps(_good(key)).encode(), [])
    finally:
        os.close(null)
    assert all(answer and "error" in answer for answer in [*answers, without_stdio]), answers
    assert server.alive(pid)
    assert log.read_text().count("refused a command: a malformed request") == len(payloads)
    assert "refused a command: not a request for this daemon's key (with stdin" in log.read_text()
    proc = client(entry_env, REPO, "echo", "5")
    out, err = proc.communicate("still here\n", timeout=120)
    assert proc.returncode == 5, err
    assert json.loads(out)["ppid"] == pid


def test_an_edit_that_keeps_size_and_mtime_changes_the_key(tmp_path):
    # The key is what decides that a command runs in a daemon that imported other code: a Kiln
    # laid out in tmp_path (flows/…) stands for the checkout, whose files other work may be using.
    source = tmp_path / "flows" / "cli.py"
    source.parent.mkdir()
    source.write_text("VALUE = 1\n")
    env = dict(os.environ)
    keys = [daemon.daemon_key(env, "/", root=tmp_path)]
    for how in ("in place", "cp -p"):
        stamp = source.stat()
        # ctime ticks with the kernel's coarse clock: wait until an edit gets a ctime of its own.
        until(time.time_ns, lambda now, s=stamp: now > s.st_ctime_ns + 50_000_000, 10)
        if how == "in place":
            with open(source, "r+b") as f:
                f.write(b"VALUE = 2\n")
        else:  # a new file renamed over the old one, as cp -p and rsync -t leave it
            new = source.with_name("cli.py.new")
            new.write_text("VALUE = 3\n")
            new.replace(source)
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        edited = source.stat()
        assert (edited.st_size, edited.st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)
        keys.append(daemon.daemon_key(env, "/", root=tmp_path))
    assert len(set(keys)) == 3, keys


@pytest.mark.parametrize("how", ["another user's", "open to others", "a symlink"])
def test_a_state_directory_not_ours_alone_is_named_once_in_a_warning(env, tmp_path, how):
    directory = state_directory(env)
    if how == "another user's":
        if os.getuid() != 0:
            pytest.skip("creating another user's directory needs root")
        directory.mkdir(mode=0o700)
        os.chown(directory, 65534, 65534)
    elif how == "open to others":
        directory.mkdir()
        directory.chmod(0o755)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        directory.symlink_to(elsewhere)
    proc = client(env, tmp_path, "build")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == NOT_SERVED  # the command runs in-process
    assert err.count(str(directory)) == 1 and "Kiln's daemon is off" in err, err
    assert list(directory.iterdir()) == []  # no daemon was started there as the command exited


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


@pytest.mark.parametrize("command", ["sleep", "block"])
def test_sigterm_to_the_client_ends_the_commands_group_and_the_client_within_30_s(entry_env, tmp_path, command):
    # "block" ignores SIGTERM, and so does the sleep it started: the client kills the group after its grace.
    start_daemon(entry_env, REPO, ENTRY)
    marker = tmp_path / "pid"
    proc = client(entry_env, REPO, command, str(marker))
    child = int(until(lambda: marker.read_text() if marker.exists() else "", bool, 120))
    assert len(_group(child)) == 2  # the command and the sleep it started
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert time.monotonic() - signalled < 30
    assert proc.returncode == 128 + signal.SIGTERM
    assert until(lambda: _group(child), lambda members: not members, 30) == []


def test_two_kiln_builds_without_prefect_api_url_the_second_runs_in_the_first_ones_daemon(env, tmp_path):
    home = tmp_path / "prefect-home"
    env = {k: v for k, v in env.items() if not k.startswith("PREFECT_API")}  # Kiln's local server
    env["PREFECT_HOME"] = str(home)
    config = copy_project("tiny", tmp_path)
    kiln = str(Path(sys.executable).parent / "kiln")
    args = ["build", "--config", str(config), "--variant", "cpu", "--version", "0.1.0.dev20261203"]
    try:
        first = subprocess.run([kiln, *args, "--out", str(tmp_path / "out1")], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stderr[-3000:]
        pid, log = _serving(env)  # started as the first exited, for the key its clients compute
        second = subprocess.run([kiln, *args, "--out", str(tmp_path / "out2")], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "Run in the Prefect UI:" in second.stdout
        assert f"kiln daemon {pid}: command pid" in log.read_text()
    finally:
        server.stop_server(home)
