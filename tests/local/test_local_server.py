"""Kiln's local Prefect server is its owner's alone, and it does not outlive its home or its use.

Real processes throughout: `kiln server start` / `kiln build` in subprocesses with their own
PREFECT_HOME and no PREFECT_API_URL (what a fresh machine has), Prefect's own `prefect server
start` under Kiln's watchdog, and another local user (`runuser -u nobody`, where the tests run
as root) trying the API with the system Python.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from kiln.flows.local import server, server_watch
from kiln.flows.local.server_home import AUTH_FILE, USED_FILE
from tests.helpers.projects import copy_project
from tests.helpers.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

IDLE_S = 12.0  # server B's idle limit: short, but longer than a status command takes on a busy machine
CHECK_S = "1"
SYSTEM_PYTHON = "/usr/bin/python3"  # another user cannot run the checkout's venv (under /root)

# What `nobody` runs: one HTTP request, its status code on stdout.
_REQUEST = """
import json, sys, urllib.error, urllib.request
method, url, body, headers = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
request = urllib.request.Request(url, data=body.encode() if body else None, method=method,
                                 headers={"Content-Type": "application/json", **headers})
try:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as answer:
        print(answer.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""
_READ = """
import os, sys
try:
    os.listdir(sys.argv[1]) if os.path.isdir(sys.argv[1]) else open(sys.argv[1], "rb").read(1)
    print("read")
except PermissionError:
    print("denied")
"""


def _kiln_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(home), "KILN_DAEMON": "off", **extra})
    return env


def _kiln(home: Path, *args: str, timeout: float = server.START_TIMEOUT_S + 120,
          **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], env=_kiln_env(home, **extra),
                          capture_output=True, text=True, timeout=timeout, cwd=home.parent)


def _needs_another_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (runuser -u nobody); this run is not root")
    if shutil.which("runuser") is None or not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"acting as another user needs runuser and {SYSTEM_PYTHON}")


def _as_nobody(*args: str) -> str:
    proc = subprocess.run(["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-I", "-c", *args],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _nobody_requests(method: str, url: str, body: object = None, headers: dict[str, str] | None = None) -> int:
    return int(_as_nobody(_REQUEST, method, url, "" if body is None else json.dumps(body),
                          json.dumps(headers or {})))


def _hold_in_use(home: Path) -> int:
    """What a running kiln command does to the idle clock: hold the use marker's shared lock."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(home / USED_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _gone(info: server.ServerInfo) -> bool:
    return not server.alive(info.pid) and not server.alive(info.watch_pid)


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Under /tmp, not pytest's private temporary directory: other users must be able to reach the
    # homes, so that only each home's own mode keeps them out.
    path = Path(tempfile.mkdtemp(prefix="kiln-local-server-", dir="/tmp" if os.path.isdir("/tmp") else None))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Homes:
    paths: dict[str, Path]
    holder: int  # the use marker of ``b``, held until the idle test lets go

    def let_go(self) -> None:
        if self.holder >= 0:
            os.close(self.holder)
            self.holder = -1


@pytest.fixture(scope="module")
def homes(base: Path) -> Iterator[Homes]:
    """Three servers started at once: ``a`` for the owner tests, ``b`` held in use until the idle
    test lets go (its idle limit is IDLE_S), ``d`` for the deleted home."""
    paths = {name: base / name for name in ("a", "b", "d")}
    settings = {"a": {"KILN_SERVER_CHECK_SECONDS": CHECK_S},
                "b": {"KILN_SERVER_CHECK_SECONDS": CHECK_S, "KILN_SERVER_IDLE_SECONDS": str(IDLE_S)},
                "d": {"KILN_SERVER_CHECK_SECONDS": CHECK_S}}
    found = Homes(paths, _hold_in_use(paths["b"]))
    try:
        with ThreadPoolExecutor(3) as pool:
            starts = dict(zip(paths, pool.map(lambda n: _kiln(paths[n], "server", "start", **settings[n]), paths),
                                  strict=True))
        for name, start in starts.items():
            assert start.returncode == 0, f"{name}: {start.stdout}\n{start.stderr}"
        yield found
    finally:
        found.let_go()
        for home in paths.values():
            if home.exists():
                server.stop_server(home)


def _info(home: Path) -> server.ServerInfo:
    info = server.read_state(home)
    assert info is not None, f"no server record in {home}"
    return info


def _auth(home: Path) -> str:
    return (home / AUTH_FILE).read_text().strip()


def _owner_client(home: Path):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api=_info(home).api_url, auth_string=_auth(home))


def test_kiln_creates_the_home_private_and_every_file_in_it_owner_only(homes):
    home = homes.paths["a"]
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    files = [p for p in home.rglob("*") if p.is_file()]
    assert {"prefect.db", AUTH_FILE, server.STATE_FILE, server.LOG_FILE} <= {p.name for p in files}
    loose = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if p.stat().st_mode & 0o077}
    assert not loose, loose


def test_another_user_can_read_neither_the_home_nor_its_database(homes):
    _needs_another_user()
    home = homes.paths["a"]
    assert _as_nobody(_READ, str(home.parent)) == "read"  # the way there is open: the home's mode is what stops
    assert _as_nobody(_READ, str(home)) == "denied"
    assert _as_nobody(_READ, str(home / "prefect.db")) == "denied"


def test_another_user_is_refused_by_the_api_while_kiln_is_served(homes):
    _needs_another_user()
    home = homes.paths["a"]
    api = _info(home).api_url
    saved = subprocess.run(
        [sys.executable, "-c", "from prefect.blocks.system import Secret; "
         "Secret(value='kiln-owner-secret').save('kiln-owner', overwrite=True); "
         "print(Secret.load('kiln-owner').get())"],
        env={**_kiln_env(home), **server.client_env(home, _info(home))}, capture_output=True, text=True,
        timeout=300)
    assert saved.stdout.strip() == "kiln-owner-secret", saved.stderr[-3000:]  # Kiln's own client is served
    assert _nobody_requests("GET", f"{api}/health") == 200  # liveness stays open, and says nothing
    assert _nobody_requests("GET", f"{api}/admin/version") == 401
    # CSRF protection answers a POST before the auth check does (403): the token it needs is behind it.
    assert _nobody_requests("GET", f"{api}/csrf-token?client=nobody") == 401
    forged = {"Prefect-Csrf-Token": "x", "Prefect-Csrf-Client": "nobody"}
    for headers in ({}, forged):
        assert _nobody_requests("POST", f"{api}/block_documents/filter", {"include_secrets": True},
                                headers) in (401, 403)
        assert _nobody_requests("POST", f"{api}/flows/", {"name": "planted-by-nobody"}, headers) in (401, 403)
    with _owner_client(home) as client:
        names = {f.name for f in client.read_flows()}
    assert "planted-by-nobody" not in names


_PAUSING_FLOW = """
from prefect import flow
from prefect.flow_runs import pause_flow_run

from kiln.flows.release import ApprovalInput


@flow(name="approval-probe")
def probe() -> str:
    answer = pause_flow_run(wait_for_input=ApprovalInput.with_initial_data(description="probe", approve=False),
                            timeout=600, poll_interval=1)
    return f"approve={answer.approve} comment={answer.comment}"


print(probe())
"""


def _paused_run(home: Path, deadline_s: float):
    with _owner_client(home) as client:
        runs = until(lambda: [r for r in client.read_flow_runs() if r.state is not None and r.state.is_paused()],
                     bool, deadline_s)
    assert runs, f"no flow run paused within {deadline_s} s"
    return runs[0]


def test_a_paused_approval_resumes_for_its_owner_and_not_for_another_user(homes):
    _needs_another_user()
    home = homes.paths["a"]
    env = {**_kiln_env(home), **server.client_env(home, _info(home))}
    with subprocess.Popen([sys.executable, "-c", _PAUSING_FLOW], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as flow:
        try:
            run = _paused_run(home, deadline_s=300)
            api = _info(home).api_url
            attempt = {"run_input": {"approve": True, "comment": "approved by nobody"}}
            assert _nobody_requests("POST", f"{api}/flow_runs/{run.id}/resume", attempt) in (401, 403)
            with _owner_client(home) as client:
                assert client.read_flow_run(run.id).state.is_paused()  # nobody changed nothing
                client.resume_flow_run(run.id, run_input={"approve": True, "comment": "owner"})
            out, err = flow.communicate(timeout=300)
        finally:
            if flow.poll() is None:
                os.killpg(flow.pid, signal.SIGKILL)
    assert flow.returncode == 0, err[-3000:]
    assert "approve=True comment=owner" in out


def test_only_the_servers_own_origin_may_call_it_from_a_browser(homes):
    import urllib.error
    import urllib.request

    info = _info(homes.paths["a"])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def preflight(origin: str) -> str | None:
        request = urllib.request.Request(f"{info.api_url}/flows/filter", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        try:
            with opener.open(request, timeout=30) as answer:
                return answer.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as exc:
            return exc.headers.get("access-control-allow-origin")

    assert preflight("http://evil.example") is None
    assert preflight(info.ui_url) == info.ui_url
    with opener.open(f"{info.ui_url}/ui-settings", timeout=30) as answer:
        ui = json.loads(answer.read())
    assert ui["auth"] == "BASIC" and ui["csrf_enabled"] is True  # the UI asks for the password
    assert ui["api_url"] == info.api_url


def test_a_kiln_flow_command_runs_on_the_owner_only_server(homes, tmp_path):
    home = homes.paths["a"]
    config = copy_project("tiny", tmp_path)
    out = tmp_path / "out"
    proc = _kiln(home, "build", "--config", str(config), "--out", str(out), "--variant", "cpu",
                 "--version", "0.1.0.dev20261203", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Run in the Prefect UI: {_info(home).ui_url}" in proc.stdout
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
    with _owner_client(home) as client:
        assert client.read_flow_run(run_dir.name).state.is_completed()


def test_status_lists_every_kiln_server_of_this_user_with_its_home(homes):
    status = _kiln(homes.paths["a"], "server", "status", timeout=300)
    assert status.returncode == 0, status.stderr
    for name, home in homes.paths.items():
        assert f"home {home}" in status.stdout, (name, status.stdout)
    assert f"home {homes.paths['a']}  (this home)" in status.stdout
    assert str(homes.paths["a"] / AUTH_FILE) in status.stdout  # how to log in to the UI: the file, not the secret
    assert _auth(homes.paths["a"]) not in status.stdout + status.stderr


def test_a_server_in_use_outlives_its_idle_time_and_an_idle_one_exits(homes):
    home = homes.paths["b"]
    info = _info(home)
    time.sleep(IDLE_S + 3 * float(CHECK_S))  # the condition under test is a duration: longer than the idle limit
    assert server.find_server(home) is not None, "a server in use ended"
    homes.let_go()  # the last command using it exits
    until(lambda: _gone(info), bool, IDLE_S + float(CHECK_S) + server_watch.STOP_GRACE_S + 30)
    assert _gone(info)
    assert "no kiln command used it" in (home / server.LOG_FILE).read_text()


def test_a_server_whose_home_is_deleted_is_gone_within_its_check_interval(homes):
    home = homes.paths["d"]
    info = _info(home)
    assert server.alive(info.pid)
    shutil.rmtree(home)
    until(lambda: _gone(info), bool, float(CHECK_S) + server_watch.STOP_GRACE_S + 10)
    assert _gone(info), f"server pid {info.pid} or its watchdog {info.watch_pid} outlived its home"


class _Squatter(BaseHTTPRequestHandler):
    """Another process on the port Kiln chose, answering the health check first and noting what it is sent."""

    seen: list[dict[str, str]] = []

    def _answer(self) -> None:
        type(self).seen.append(dict(self.headers))
        body = b"true" if self.path.endswith("/health") else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):  # keep the test output quiet
        pass


def test_a_listener_squatting_on_the_chosen_port_is_not_adopted(tmp_path, monkeypatch):
    squatter = HTTPServer((server.HOST, 0), _Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    port = squatter.server_port
    # Fault injection: the squatter takes the port between Kiln choosing it and the server binding it.
    chosen = server._choose_port
    monkeypatch.setattr(server, "_choose_port", lambda attempt: port if attempt == 0 else chosen(attempt))
    home = tmp_path / "prefect-home"
    try:
        info = server.ensure_server(home)
        assert info.port != port and server.find_server(home) == info
        assert f"Port {port} is already in use" in (home / server.LOG_FILE).read_text()
        assert not [h for h in _Squatter.seen if "Authorization" in h], "the squatter was sent the auth string"
        assert _Squatter.seen == []  # not even asked for its health: the port was not the server's
        # A record naming the squatter's port (a server that died, its port taken since) is not trusted.
        server._write_state(home, server.ServerInfo(**{**info.__dict__, "port": port,
                                                          "api_url": f"http://{server.HOST}:{port}/api"}))
        assert server.find_server(home) is None and _Squatter.seen == []
    finally:
        squatter.shutdown()
        server._write_state(home, info)
        server.stop_server(home)
    assert _gone(info)


def test_the_server_ends_when_its_watchdog_is_killed(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    watchdog = subprocess.Popen([sys.executable, "-P", "-m", server_watch.MODULE, "--home", str(home), "--port", "1",
                                 "--check-s", "60", "--", sys.executable, "-c", "import time; time.sleep(600)"],
                                start_new_session=True)
    try:
        child = until(lambda: server._child_of(watchdog.pid), lambda pid: pid is not None, 60)
        assert child is not None and server.alive(child)
        watchdog.kill()  # SIGKILL: no handler of its own runs
        watchdog.wait(timeout=30)
        until(lambda: server.alive(child), lambda up: not up, 30)
        assert not server.alive(child), "the server outlived its watchdog"
    finally:
        if watchdog.poll() is None:
            os.killpg(watchdog.pid, signal.SIGKILL)


def test_work_runs_while_the_server_starts_and_not_when_one_runs(tmp_path):
    home = tmp_path / "home"
    seen: list[object] = []

    def meanwhile() -> None:
        seen.append(server.find_server(home))  # the server it waits for: started, not yet answering
        raise RuntimeError("planted: an error of the head start")  # fault injection: dropped, the start goes on

    try:
        info = server.ensure_server_while(home, meanwhile)
        assert seen == [None] and server.find_server(home) == info
        assert server.ensure_server_while(home, lambda: seen.append("again")) == info
        assert seen == [None]  # a running server: nothing to fill
    finally:
        server.stop_server(home)
