"""A real PyPI-compatible server (pypiserver) on loopback, started and stopped by the test that uses it."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.processes import stop
from tests.helpers.waiting import until

CHILD = Path(__file__).with_name("pypiserver_child.py")
START_DEADLINE_S = 60.0


@dataclass(frozen=True)
class PypiServer:
    url: str  # the upload API (pypiserver takes uploads at its root)
    packages: Path  # what it serves, as files
    log: Path

    @property
    def index_url(self) -> str:
        return f"{self.url}simple/"

    def uploads(self) -> int:
        """How many uploads (POSTs) the server has answered."""
        return sum(1 for line in self.log.read_text().splitlines() if line.startswith("request: \"POST "))


def _port(proc: subprocess.Popen[str], log: Path) -> int:
    """The port the child prints first, read under a deadline (it never blocks the test)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=START_DEADLINE_S):
            raise RuntimeError(f"pypiserver printed no port within {START_DEADLINE_S:.0f} s: {log.read_text()}")
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        raise RuntimeError(f"pypiserver did not start: {line!r} {log.read_text()}")
    return int(line)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def pypi_server(root: Path, token: str | None = None) -> Iterator[PypiServer]:
    """Serve ``root/packages`` on 127.0.0.1 until the block ends; the process group is killed in any case.

    ``token``: the only password an upload is taken with (else any is)."""
    packages, log = root / "packages", root / "pypiserver.log"
    packages.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "KILN_TEST_PYPISERVER_TOKEN"}
    with open(log, "w") as errors:
        proc = subprocess.Popen([sys.executable, str(CHILD), str(packages)], stdout=subprocess.PIPE,
                                stderr=errors, text=True, start_new_session=True,
                                env=env | ({"KILN_TEST_PYPISERVER_TOKEN": token} if token else {}))
    try:
        url = f"http://127.0.0.1:{_port(proc, log)}/"
        started = time.monotonic()
        if not until(lambda: _healthy(url), bool, deadline_s=START_DEADLINE_S):
            raise RuntimeError(f"pypiserver at {url} not healthy after {time.monotonic() - started:.0f} s")
        yield PypiServer(url, packages, log)
    finally:
        stop(proc)
