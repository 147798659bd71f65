"""``python -m http.server`` over a directory: a plain static server, no content negotiation.

Started as a subprocess on 127.0.0.1, port 0; the port the OS chose is read
from the line the server prints, then the server is polled until it answers.
Stopped by its PID: SIGTERM, then SIGKILL if it does not exit in time.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_DEADLINE_S = 120.0  # a busy 2-core CI machine starts an interpreter slowly
STOP_DEADLINE_S = 30.0
_SERVING = re.compile(rb"port (\d+)")


def _first_line(process: subprocess.Popen[bytes], deadline: float) -> bytes:
    assert process.stdout is not None
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or process.poll() is not None:
                raise RuntimeError(f"http.server did not say where it serves (exit {process.poll()}, printed {buffer!r})")
            if selector.select(remaining):
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"http.server closed its output before serving (printed {buffer!r})")
                buffer += chunk
    return buffer


def _wait_until_answering(url: str, process: subprocess.Popen[bytes], deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10):
                return
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"http.server at {url} never answered: {exc}") from exc
        time.sleep(0.05)  # poll interval of a condition checked each round, not a guess at readiness


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_DEADLINE_S)
    if process.stdout is not None:
        process.stdout.close()


@contextmanager
def static_server(directory: Path) -> Iterator[str]:
    """Yield ``http://127.0.0.1:<port>/`` serving ``directory`` until the block ends."""
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(directory)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,  # stderr is its request log: unread, it could fill
    )
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        match = _SERVING.search(_first_line(process, deadline))
        if match is None:
            raise RuntimeError("http.server printed no port")
        url = f"http://127.0.0.1:{int(match.group(1))}/"
        _wait_until_answering(url, process, deadline)
        yield url
    finally:
        _stop(process)
