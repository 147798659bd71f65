"""The hostile fixture's opponents: the step's secrets it looks for, and listeners outside every sandbox that
count who reached them (tests/fixtures/projects/hostile)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from tests.helpers.gitrepo import FIXTURES
from tests.helpers.sdists import write_sdist

SECRETS = {"AWS_SECRET_ACCESS_KEY": "aws-secret", "AWS_ACCESS_KEY_ID": "AKIAKILNTEST",
           "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "oidc-token", "ACTIONS_ID_TOKEN_REQUEST_URL": "http://127.0.0.1:9/oidc",
           "TWINE_PASSWORD": "pypi-token", "GITHUB_TOKEN": "ghp-token", "PREFECT_API_KEY": "pnu-key",
           "PYPI_ID_TOKEN": "gitlab-oidc"}  # the last: a GitLab job's id_tokens entry, named by its job


class Listener:
    """A TCP listener outside every sandbox, counting who reached it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.server = socket.socket()
        self.server.bind((host, 0))
        self.port = int(self.server.getsockname()[1])
        self.server.listen()
        self.server.settimeout(0.2)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.server.close()


def own_address() -> str:
    """This machine's address on its own network (not loopback): the one its route to the outside leaves from.
    A UDP socket's connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), f"no address off loopback here ({address}): nothing to test against"
    return address


def helper_sdist(dest: Path, targets: dict[str, object] | None = None) -> Path:
    """The hostile build requirement (the fixture's helper/, with its probe) as an sdist: an installer builds it.
    ``targets``: what its hook tries when installed (an installer's environment has no HOSTILE_TARGETS), baked in
    as ``hostile_targets.json``."""
    helper = FIXTURES / "hostile" / "helper"
    files = {p.relative_to(helper).as_posix(): p.read_bytes() for p in helper.rglob("*") if p.is_file()}
    files["hostile_probe.py"] = (FIXTURES / "hostile" / "tests" / "hostile_probe.py").read_bytes()
    if targets is not None:
        files["hostile_targets.json"] = json.dumps(targets).encode()
    dest.mkdir()
    return write_sdist(dest, "hostile-helper", "0.1.0", dict(sorted(files.items())))
