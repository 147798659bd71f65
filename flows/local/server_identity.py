"""Is the server on this port the one Kiln started? Answered without trusting what the port says.

A health check alone cannot tell: another local user can bind the port Kiln
was about to use and answer ``/api/health`` first. So the listening socket
must belong to the server's own process (``/proc/net/tcp`` against
``/proc/<pid>/fd``), checked before the auth string is sent anywhere; then
the API must refuse a request without the auth string and answer ours.
"""

from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request
from pathlib import Path

HEALTH_TIMEOUT_S = 3.0
#: An endpoint behind the auth string (``/health`` is open to everyone).
_PROBE = "/admin/version"
#: The listening addresses that receive connections to 127.0.0.1 (/proc/net/tcp and tcp6 notation).
_LOOPBACK_V4 = frozenset({"0100007F", "00000000"})
_LOOPBACK_V6 = frozenset({"0" * 32, "0000000000000000FFFF00000100007F"})
# Never through a proxy from the environment: the auth string goes only to our own server.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _listeners(port: int) -> set[int]:
    """Inodes of the sockets listening on ``port`` that take connections to 127.0.0.1."""
    inodes: set[int] = set()
    for table, addresses in (("/proc/net/tcp", _LOOPBACK_V4), ("/proc/net/tcp6", _LOOPBACK_V6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and address in addresses:  # 0A: LISTEN
                inodes.add(int(fields[9]))
    return inodes


def _sockets_of(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def owns_port(pid: int, port: int) -> bool:
    """True when every socket listening on 127.0.0.1:``port`` is ``pid``'s (and there is one).

    Checked before the auth string is sent anywhere: a listener another user put on the
    port answers whatever it likes, and would learn the secret from our request.
    """
    listening = _listeners(port)
    return bool(listening) and listening <= _sockets_of(pid)


def _status(url: str, auth: str | None, timeout_s: float) -> int | None:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def answers_only_us(api_url: str, auth: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the API refuses a request without ``auth`` (401) and answers one with it (200)."""
    return (_status(api_url + _PROBE, None, timeout_s) == 401
            and _status(api_url + _PROBE, auth, timeout_s) == 200)


def healthy(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when ``api_url``/health answers ``true`` (open to anyone: says nothing about whose server it is)."""
    try:
        with _OPENER.open(f"{api_url}/health", timeout=timeout_s) as response:
            return bool(response.status == 200 and response.read().strip() == b"true")
    except (urllib.error.URLError, OSError, ValueError):
        return False
