"""Kiln's daemon in tests: a private state directory, a daemon started and waited for, a client process.

Real processes throughout: the daemon is started the way ``kiln`` starts it
(:func:`kiln.flows.local.daemon.daemon_command_line`), and a client is a Python process that calls
:func:`kiln.flows.local.daemon.run` (exit 97 when the daemon did not run the command).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.flows.local import daemon
from kiln.flows.local.daemon_server import running
from kiln.flows.local.server import stop_pid
from tests.helpers.waiting import until

REPO = Path(__file__).resolve().parents[2]
#: A client: runs its argv through the daemon; 97 when it would run the command in-process.
CLIENT = "import sys; from kiln.flows.local import daemon; s = daemon.run(sys.argv[1:]); sys.exit(97 if s is None else s)"
NOT_SERVED = 97


def state_directory(env: dict[str, str]) -> Path:
    return Path(env["TMPDIR"]) / f"kiln-{os.getuid()}"


@contextlib.contextmanager
def daemon_env() -> Iterator[dict[str, str]]:
    """An environment whose daemons live in a state directory of their own (short: it holds a socket).

    Every daemon started under it is stopped at the end.
    """
    tmp = tempfile.mkdtemp(prefix="kd-", dir="/tmp")
    values = {**os.environ, "TMPDIR": tmp, "KILN_DAEMON": "auto", "KILN_DAEMON_IDLE_SECONDS": "120"}
    try:
        yield values
    finally:
        directory = state_directory(values)
        for _, pid in running(directory) if directory.is_dir() else []:
            stop_pid(pid)


def key_of(env: dict[str, str], cwd: Path) -> str:
    """The key a client in ``cwd`` computes (a process of its own: its environment is ``env``)."""
    return subprocess.run([sys.executable, "-P", "-c", "import os; from kiln.flows.local import daemon; "
                           "print(daemon.daemon_key(os.environ, os.getcwd()))"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()


def start_daemon(env: dict[str, str], cwd: Path, entry: str | None = None) -> tuple[int, Path]:
    """Start a daemon for (env, cwd) and wait until it serves; its pid and log.

    A daemon whose sources changed while it imported them exits (another key is due): started
    again, up to three times, for a checkout that is being edited while its tests run.
    """
    for _ in range(3):
        key = key_of(env, cwd)
        directory = state_directory(env)
        directory.mkdir(mode=0o700, exist_ok=True)
        sock, lock, log = daemon.paths_for(key, directory)
        with open(log, "ab") as out:
            proc = subprocess.Popen(daemon.daemon_command_line(key, entry), env=env, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        until(lambda s=sock, p=proc: s.exists() or p.poll() is not None, bool, 180)
        if sock.exists() or "sources changed" not in log.read_text():
            break
    assert sock.exists(), log.read_text()
    return int(lock.read_text()), log


def client(env: dict[str, str], cwd: Path, *args: str, prelude: str = "", **kw: Any) -> subprocess.Popen[str]:
    """A client running ``kiln ARGS`` through the daemon; ``prelude`` runs first (a umask, a limit)."""
    return subprocess.Popen([sys.executable, "-P", "-c", prelude + CLIENT, *args], env=env, cwd=cwd, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
