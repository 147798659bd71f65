"""One local Prefect server per machine, started on first use and reused by every command.

A temporary Prefect server costs 15–50 s to start; paying it in every
``kiln`` command made a warm build take 40 s for one second of work. Like a
build daemon, Kiln keeps Prefect's own ``prefect server start`` running in
the background instead — on loopback, with its SQLite database under
``PREFECT_HOME`` — and every later command finds it and connects.

State under ``PREFECT_HOME`` (one server per Prefect home, so tests with a
temporary home never meet the developer's server):

- ``kiln-server.json`` — pid, port, API URL, Prefect version of the running
  server (written atomically once the server answers its health check);
- ``kiln-server.lock`` — ``fcntl`` lock held while a command finds or
  starts the server, so two commands starting at once end up with one;
- ``kiln-server.log`` — the server's output.

A state file is trusted only if its pid is alive, is a ``prefect server
start`` on the recorded port, and the port answers ``/api/health``: a stale
file (a dead pid, or a pid the system gave to another process) is replaced.

No Prefect import here: finding a running server costs one HTTP request.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version as dist_version
from pathlib import Path
from collections.abc import Iterator

from kiln.release.errors import InfrastructureError
from kiln.release.fsutil import atomic_write_text
from kiln.tasks.process import terminate

_log = logging.getLogger("kiln.server")

HOST = "127.0.0.1"
PREFERRED_PORT = 4200  # Prefect's own default: the UI at the address its docs give
STATE_FILE, LOCK_FILE, LOG_FILE = "kiln-server.json", "kiln-server.lock", "kiln-server.log"
# A fresh SQLite database is migrated on first start; on a loaded 2-core machine
# that alone took minutes, so the deadline is generous (Prefect's own ephemeral
# start-up timeout is raised to the same value in kiln.flows.environment).
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0
HEALTH_TIMEOUT_S = 3.0
START_ATTEMPTS = 3  # a port taken between choosing it and the server binding it
_POLL_S = 0.1


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    port: int
    api_url: str
    prefect_version: str
    log: str
    started_at: float

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")


def _state_path(home: Path) -> Path:
    return home / STATE_FILE


def read_state(home: Path) -> ServerInfo | None:
    """The recorded server, or None when there is no (readable) record."""
    try:
        return ServerInfo(**json.loads(_state_path(home).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        _log.warning("ignoring unreadable %s: %s", _state_path(home), exc)
        return None


def _proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` ("R", "S", "Z", …), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is this process's child (a test that started a server)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: init collects it


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is dead: it only waits to be reaped)."""
    _reap(pid)
    state = _proc_state(pid)
    return state is not None and state != "Z"


def is_our_server(info: ServerInfo) -> bool:
    """True when ``info.pid`` is a live ``prefect server start`` on ``info.port`` (not a reused pid)."""
    if not alive(info.pid):
        return False
    try:
        argv = Path(f"/proc/{info.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [a.decode("utf-8", "replace") for a in argv]
    return "prefect" in args and "server" in args and "start" in args and str(info.port) in args


def healthy(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when ``api_url``/health answers ``true``."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
            return bool(response.status == 200 and response.read().strip() == b"true")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def find_server(home: Path) -> ServerInfo | None:
    """The recorded server if it is ours, alive and healthy; None otherwise."""
    info = read_state(home)
    if info is None or not is_our_server(info) or not healthy(info.api_url):
        return None
    installed = dist_version("prefect")
    if info.prefect_version != installed:
        # Not restarted: another checkout with its own Prefect may be using it right now.
        _log.warning("the Prefect server at %s runs Prefect %s, this environment has %s; `kiln server stop` "
                     "restarts it with this one on the next command", info.api_url, info.prefect_version, installed)
    return info


@contextmanager
def _locked(home: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``kiln-server.lock`` (bounded wait: the holder itself waits at most its start deadline)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_FILE, "a") as handle:
        end = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise InfrastructureError(f"another kiln command held {home / LOCK_FILE} for more than "
                                              f"{timeout_s:g} s while starting the Prefect server") from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _choose_port(attempt: int) -> int:
    if attempt == 0 and _port_free(PREFERRED_PORT):
        return PREFERRED_PORT
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _server_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    env["PREFECT_HOME"] = str(home)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _spawn(home: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    _log.info("starting the Prefect server: %s (log: %s)", " ".join(command), log_path)
    with open(log_path, "ab") as log:
        # Its own session: Ctrl-C on the command that started it does not reach it,
        # and one killpg(pid) reaches whatever it started.
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_server_env(home), cwd=home, start_new_session=True, close_fds=True)


def _wait_healthy(process: subprocess.Popen[bytes], api_url: str, deadline: float) -> bool:
    """True once healthy; False if the process exited first. Raises past ``deadline``."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if healthy(api_url, timeout_s=min(HEALTH_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))):
            return True
        time.sleep(_POLL_S)
    raise TimeoutError


def _start(home: Path, timeout_s: float) -> ServerInfo:
    log_path = home / LOG_FILE
    deadline = time.monotonic() + timeout_s
    for attempt in range(START_ATTEMPTS):
        port = _choose_port(attempt)
        api_url = f"http://{HOST}:{port}/api"
        process = _spawn(home, port, log_path)
        try:
            up = _wait_healthy(process, api_url, deadline)
        except TimeoutError:
            stop_pid(process.pid)
            raise InfrastructureError(
                f"the Prefect server (pid {process.pid}) did not answer {api_url}/health "
                f"within {timeout_s:g} s; its log {log_path} ends:\n{_log_tail(log_path)}"
            ) from None
        if up:
            info = ServerInfo(process.pid, port, api_url, dist_version("prefect"), str(log_path), time.time())
            atomic_write_text(_state_path(home), json.dumps(asdict(info), indent=2) + "\n")
            _log.info("Prefect server pid %d is up at %s", info.pid, api_url)
            return info
        _log.warning("the Prefect server on port %d exited with status %s; trying another port",
                     port, process.returncode)
    raise InfrastructureError(f"the Prefect server exited {START_ATTEMPTS} times before answering; "
                              f"its log {log_path} ends:\n{_log_tail(log_path)}")


def ensure_server(home: Path, timeout_s: float = START_TIMEOUT_S) -> ServerInfo:
    """The running server for ``home``, started first if there is none (or only a stale record)."""
    info = find_server(home)  # the common case: no lock, one HTTP request
    if info is not None:
        return info
    with _locked(home, timeout_s + STOP_GRACE_S):
        info = find_server(home)  # started by the command that held the lock before us
        if info is not None:
            return info
        stale = read_state(home)
        if stale is not None and is_our_server(stale):
            _log.warning("Prefect server pid %d does not answer %s/health; replacing it", stale.pid, stale.api_url)
            stop_pid(stale.pid)
        _state_path(home).unlink(missing_ok=True)
        return _start(home, timeout_s)


class _Detached:
    """kiln.tasks.process's Child protocol for a process that may not be our child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while alive(self.pid):
            if time.monotonic() >= end:
                return None
            time.sleep(_POLL_S)
        return 0


def stop_pid(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``, wait until it is gone."""
    terminate(_Detached(pid), grace_s, dump=False)


def stop_server(home: Path, grace_s: float = STOP_GRACE_S) -> ServerInfo | None:
    """Stop the recorded server of ``home``; returns what was stopped (None: nothing ran)."""
    with _locked(home, START_TIMEOUT_S + grace_s):
        info = read_state(home)
        running = info is not None and is_our_server(info)
        if running:
            assert info is not None
            stop_pid(info.pid, grace_s)
        _state_path(home).unlink(missing_ok=True)
        return info if running else None


def server_status(home: Path) -> tuple[ServerInfo | None, str]:
    """The recorded server and a word for its state: running, unhealthy, stale or stopped."""
    info = read_state(home)
    if info is None:
        return None, "stopped"
    if not is_our_server(info):
        return info, "stale"
    return info, "running" if healthy(info.api_url) else "unhealthy"
