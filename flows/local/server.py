"""One local Prefect server per machine, started on first use and reused by every command.

A temporary Prefect server costs 15–50 s to start; paying it in every
``kiln`` command made a warm build take 40 s for one second of work. Like a
build daemon, Kiln keeps Prefect's own ``prefect server start`` running in
the background instead — on loopback, with its SQLite database under
``PREFECT_HOME`` — and every later command finds it and connects.

Only its owner can use it: the server is started with the home's random auth
string (``PREFECT_SERVER_API_AUTH_STRING``, :mod:`kiln.flows.local.server_home`),
which Kiln's clients send (``PREFECT_API_AUTH_STRING``), CORS allows only the
server's own origin and CSRF protection is on. A team server
(``PREFECT_API_URL`` set) is never touched.

It starts under a watchdog (:mod:`kiln.flows.local.server_watch`) that ends it when
its home is gone or after ``KILN_SERVER_IDLE_SECONDS`` (default a day) without
a ``kiln`` command; ``KILN_SERVER_CHECK_SECONDS`` is how often it looks.

State under ``PREFECT_HOME`` (one server per Prefect home, so tests with a
temporary home never meet the developer's server; the home is 0700, Kiln's
files in it 0600):

- ``kiln-server.json`` — pids (server and watchdog), port, API URL, Prefect
  version of the running server (written atomically once the server answers);
- ``kiln-server.lock`` — ``fcntl`` lock held while a command finds or
  starts the server, so two commands starting at once end up with one;
- ``kiln-server.log`` — the watchdog's and the server's output;
- ``kiln-server.auth``, ``kiln-server.used`` — see :mod:`kiln.flows.local.server_home`.

A state file is trusted only if its pid is alive and is a ``prefect server
start`` on the recorded port, the port's listening socket belongs to that
process (so a listener another user put on the port is never adopted, and
never sees the auth string), and the API refuses a request without the auth
string while it accepts ours. Anything else is stale and replaced.

No Prefect import here: finding a running server costs two HTTP requests.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version as dist_version
from pathlib import Path
from urllib.parse import quote

from kiln.core.errors import InfrastructureError
from kiln.flows.local import server_watch
from kiln.flows.local.server_home import (
    AUTH_FILE,
    auth_string,
    existing_auth_string,
    mark_used,
    open_private,
    private_home,
)
from kiln.flows.local.server_identity import HEALTH_TIMEOUT_S, answers_only_us, owns_port
from kiln.flows.local.server_identity import healthy as healthy
from kiln.tasks.process import terminate

_log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PREFERRED_PORT = 4200  # Prefect's own default: the UI at the address its docs give
STATE_FILE, LOCK_FILE, LOG_FILE = "kiln-server.json", "kiln-server.lock", "kiln-server.log"
# A fresh SQLite database is migrated on first start; on a loaded 2-core machine
# that alone took minutes, so the deadline is generous (Prefect's own ephemeral
# start-up timeout is raised to the same value in kiln.flows.local.environment).
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0
START_ATTEMPTS = 3  # a port taken between choosing it and the server binding it
_POLL_S = 0.1


@dataclass(frozen=True)
class ServerInfo:
    pid: int  # the `prefect server start` process (its own process group)
    port: int
    api_url: str
    prefect_version: str
    log: str
    started_at: float
    watch_pid: int = 0  # its watchdog (kiln.flows.local.server_watch); 0 in records of older Kiln versions
    idle_s: float = 0.0
    check_s: float = 0.0

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


def _write_state(home: Path, info: ServerInfo) -> None:
    """Replace the record atomically; the file is 0600 like everything Kiln keeps in the home."""
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=home)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(asdict(info), indent=2) + "\n")
        os.replace(tmp, _state_path(home))
    finally:
        Path(tmp).unlink(missing_ok=True)


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


def _argv(pid: int) -> list[str]:
    try:
        return [a.decode("utf-8", "replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return []


def _mine(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}").stat().st_uid == os.getuid()
    except OSError:
        return False


def is_our_server(info: ServerInfo) -> bool:
    """True when ``info.pid`` is this user's live ``prefect server start`` on ``info.port`` (not a reused pid)."""
    if not (alive(info.pid) and _mine(info.pid)):
        return False
    args = _argv(info.pid)
    return "prefect" in args and "server" in args and "start" in args and str(info.port) in args


def _is_watchdog(info: ServerInfo) -> bool:
    return (info.watch_pid > 0 and alive(info.watch_pid) and _mine(info.watch_pid)
            and server_watch.MODULE in _argv(info.watch_pid))


def _ours_and_answering(home: Path, info: ServerInfo) -> bool:
    if not (is_our_server(info) and owns_port(info.pid, info.port)):
        return False
    auth = existing_auth_string(home)
    return auth is not None and answers_only_us(info.api_url, auth)


def find_server(home: Path) -> ServerInfo | None:
    """The recorded server if it is ours, alive and answers only our auth string; None otherwise."""
    info = read_state(home)
    if info is None or not _ours_and_answering(home, info):
        return None
    installed = dist_version("prefect")
    if info.prefect_version != installed:
        # Not restarted: another checkout with its own Prefect may be using it right now.
        _log.warning("the Prefect server at %s runs Prefect %s, this environment has %s; `kiln server stop` "
                     "restarts it with this one on the next command", info.api_url, info.prefect_version, installed)
    return info


def ui_login(home: Path) -> str:
    """How to log in to the local server's UI (the file's path: the secret itself is never printed)."""
    info = read_state(home)
    limits = (f"; it exits after {info.idle_s:g} s without a kiln command or once {home} is gone"
              if info is not None and info.idle_s else "")
    return (f"UI login: the UI asks for a password; it is the auth string in {home / AUTH_FILE} "
            f"(owner-only){limits}")


def login_link(ui_url: str, link: str) -> str:
    """The UI's login page that opens ``link`` once the password is in.

    The run's own link, opened before logging in, lands on the login page too, but greets the user with
    Prefect's "Authentication failed" toast first; the login page itself asks without the error, and sends
    the browser to its ``redirect`` path after the password is accepted.
    """
    path = link.removeprefix(ui_url) or "/"
    return f"{ui_url}/login?redirect={quote(path, safe='/')}"


def ui_login_for(home: Path, link: str) -> str | None:
    """Where the password is, and the login page that lands on ``link``, when ``link`` is on this home's local
    server (whose UI asks for the password); else None: a team's server has its own way in."""
    info = read_state(home)
    if info is None or not link.startswith(f"{info.ui_url}/"):
        return None
    return (f"UI login: the password is the auth string in {home / AUTH_FILE} (owner-only); "
            f"{login_link(info.ui_url, link)} asks for it, then opens the run")


def client_env(home: Path, info: ServerInfo) -> dict[str, str]:
    """What a Prefect client needs to use the local server: its URL and the home's auth string."""
    return {"PREFECT_API_URL": info.api_url, "PREFECT_API_AUTH_STRING": auth_string(home)}


@contextmanager
def _locked(home: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``kiln-server.lock`` (bounded wait: the holder itself waits at most its start deadline)."""
    private_home(home)
    fd = open_private(home / LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        end = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise InfrastructureError(f"another kiln command held {home / LOCK_FILE} for more than "
                                              f"{timeout_s:g} s while starting the Prefect server") from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


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


def _server_env(home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    origin = f"http://{HOST}:{port}"
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": HOST,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_API_AUTH_STRING": auth_string(home),
        # The UI calls the API of the origin it was loaded from; no other web page may.
        "PREFECT_SERVER_UI_API_URL": f"{origin}/api",
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"{origin},http://localhost:{port}",
        "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
    })
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _spawn(home: Path, port: int, log_path: Path, idle_s: float, check_s: float) -> subprocess.Popen[bytes]:
    """The watchdog, which starts ``prefect server start`` (``-P``: nothing imported from the home)."""
    command = [sys.executable, "-P", "-m", server_watch.MODULE, "--home", str(home), "--port", str(port),
               "--idle-s", repr(idle_s), "--check-s", repr(check_s), "--",
               sys.executable, "-P", "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    _log.info("starting the Prefect server: %s (log: %s)", " ".join(command), log_path)
    log = open_private(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        # Its own session: Ctrl-C on the command that started it does not reach it. The umask
        # makes prefect.db (block secrets and their key) and everything else it creates 0600.
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_server_env(home, port), cwd=home, start_new_session=True, close_fds=True,
                                umask=0o077)
    finally:
        os.close(log)


def _child_of(pid: int) -> int | None:
    """The watchdog's one child (the server), None before it has started it."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _accepts(port: int) -> bool:
    """Whether anything accepts connections on ``port`` yet: one connect, nothing sent, before the checks that
    read ``/proc`` (every socket of the machine, 10 times a second, took 2 s of CPU from a starting server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(HEALTH_TIMEOUT_S)
        return probe.connect_ex((HOST, port)) == 0


def _wait_ours(watch: subprocess.Popen[bytes], port: int, auth: str, deadline: float) -> int | None:
    """The server's pid once it listens on ``port`` and answers only ``auth``; None if it exited first.

    Raises TimeoutError past ``deadline``.
    """
    api_url = f"http://{HOST}:{port}/api"
    while time.monotonic() < deadline:
        if watch.poll() is not None:
            return None
        pid = _child_of(watch.pid)
        timeout_s = min(HEALTH_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))
        if pid is not None and _accepts(port) and owns_port(pid, port) and answers_only_us(api_url, auth, timeout_s):
            return pid
        time.sleep(_POLL_S)
    raise TimeoutError


def _start(home: Path, timeout_s: float) -> ServerInfo:
    log_path = home / LOG_FILE
    auth = auth_string(home)
    idle_s = server_watch.seconds_setting(os.environ, "KILN_SERVER_IDLE_SECONDS", server_watch.DEFAULT_IDLE_S)
    check_s = server_watch.seconds_setting(os.environ, "KILN_SERVER_CHECK_SECONDS", server_watch.DEFAULT_CHECK_S)
    deadline = time.monotonic() + timeout_s
    for attempt in range(START_ATTEMPTS):
        port = _choose_port(attempt)
        watch = _spawn(home, port, log_path, idle_s, check_s)
        try:
            pid = _wait_ours(watch, port, auth, deadline)
        except TimeoutError:
            stop_pid(watch.pid)
            raise InfrastructureError(
                f"the Prefect server (watchdog pid {watch.pid}) did not answer on port {port} "
                f"within {timeout_s:g} s; its log {log_path} ends:\n{_log_tail(log_path)}"
            ) from None
        if pid is not None:
            info = ServerInfo(pid, port, f"http://{HOST}:{port}/api", dist_version("prefect"), str(log_path),
                              time.time(), watch.pid, idle_s, check_s)
            _write_state(home, info)
            _log.info("Prefect server pid %d is up at %s", info.pid, info.api_url)
            return info
        _log.warning("the Prefect server on port %d exited with status %s (the port may be taken); "
                     "trying another port", port, watch.returncode)
    raise InfrastructureError(f"the Prefect server exited {START_ATTEMPTS} times before answering; "
                              f"its log {log_path} ends:\n{_log_tail(log_path)}")


def ensure_server(home: Path, timeout_s: float = START_TIMEOUT_S) -> ServerInfo:
    """The running server for ``home``, started first if there is none (or only a stale record).

    The calling process counts as using the server until it exits (the watchdog's idle clock).
    """
    private_home(home)
    info = find_server(home)  # the common case: no lock, two HTTP requests
    if info is None:
        with _locked(home, timeout_s + STOP_GRACE_S):
            info = find_server(home)  # started by the command that held the lock before us
            if info is None:
                _stop_recorded(home, "it does not answer as Kiln's server")
                info = _start(home, timeout_s)
    mark_used(home)
    return info


def ensure_server_while(home: Path, meanwhile: Callable[[], object]) -> ServerInfo:
    """:func:`ensure_server`, running ``meanwhile`` in this thread while a server starts (seconds: a first
    start creates Prefect's database); not called when the server already runs.

    ``meanwhile`` is work the command would do next anyway, which needs no server: it only fills the wait.
    An error of it is logged and dropped (the command meets it again where it really does that work); the
    server's error, if it did not start, is raised here once ``meanwhile`` has returned.
    """
    private_home(home)
    info = find_server(home)
    if info is not None:
        mark_used(home)
        return info
    started: list[ServerInfo] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:
            started.append(ensure_server(home))
        except BaseException as exc:  # handed to the command's own thread, which raises it
            failed.append(exc)

    # A daemon: the server it starts belongs to its watchdog, not to this command (see ensure_server).
    thread = threading.Thread(target=start, name="kiln-server-start", daemon=True)
    thread.start()
    try:
        meanwhile()
    except Exception as exc:  # a head start only: the command does this work again and reports it there
        _log.debug("work done while the Prefect server started failed (done again later): %s", exc)
    thread.join()
    if failed:
        raise failed[0]
    return started[0]


def _stop_recorded(home: Path, why: str, grace_s: float = STOP_GRACE_S) -> ServerInfo | None:
    """Stop what the record names (watchdog, then server) if it still runs; remove the record."""
    info = read_state(home)
    running = info is not None and (_is_watchdog(info) or is_our_server(info))
    if info is not None and running:
        _log.info("stopping the Prefect server pid %d (%s): %s", info.pid, info.api_url, why)
        if _is_watchdog(info):
            stop_pid(info.watch_pid, grace_s)  # it ends the server's group first
        if is_our_server(info):
            stop_pid(info.pid, grace_s)
    _state_path(home).unlink(missing_ok=True)
    return info if running else None


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
    """SIGTERM ``pid``'s process group, SIGKILL it after ``grace_s``, wait until it is gone."""
    terminate(_Detached(pid), grace_s, dump=False)


def stop_server(home: Path, grace_s: float = STOP_GRACE_S) -> ServerInfo | None:
    """Stop the recorded server of ``home``; returns what was stopped (None: nothing ran)."""
    with _locked(home, START_TIMEOUT_S + grace_s):
        return _stop_recorded(home, "asked to stop", grace_s)


def server_status(home: Path) -> tuple[ServerInfo | None, str]:
    """The recorded server and a word for its state: running, unhealthy, stale or stopped."""
    info = read_state(home)
    if info is None:
        return None, "stopped"
    if not is_our_server(info):
        return info, "stale"
    return info, "running" if _ours_and_answering(home, info) else "unhealthy"
