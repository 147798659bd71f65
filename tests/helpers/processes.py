"""Services the tests start as subprocesses: a free loopback port, a health probe, stopping a process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request

# The workers tests start look for scheduled runs every 2 s, not Prefect's 10: a dispatched unit is picked up
# sooner. No test waits on this interval; each waits for the state it checks.
WORKER_QUERY_S = "2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process group, then SIGKILL it if it is still there.

    The group is signalled even when its leader has exited already: what the
    leader started (a worker's flow run, a server's children) may still run.
    """
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()


def healthy(api_url: str) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
