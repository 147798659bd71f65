"""What Kiln keeps in a Prefect home for its local server: a private directory, the auth string, the use marker.

A Prefect home holds the server's SQLite database, and with it every block's
encrypted secrets next to their key; Kiln's local server accepts only clients
that send the home's auth string. Both are worth exactly as much as the home's
permissions, so Kiln creates the home 0700 and its own files 0600, and names a
home other users can read or write in a warning (once per process).

- ``kiln-server.auth`` — the random auth string the server was started with
  (``PREFECT_SERVER_API_AUTH_STRING``); Kiln's clients send it
  (``PREFECT_API_AUTH_STRING``) and the UI asks for it as its password;
- ``kiln-server.used`` — touched by every command that uses the server, and
  held with a shared ``flock`` for the command's life: the server's watchdog
  (:mod:`kiln.flows.local.server_watch`) ends an idle server from it.

No Prefect import here.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from kiln.core.errors import InfrastructureError

_log = logging.getLogger(__name__)

AUTH_FILE, USED_FILE = "kiln-server.auth", "kiln-server.used"
HOME_MODE, FILE_MODE = 0o700, 0o600
_AUTH_BYTES = 32
_HOLD_ATTEMPTS = 20  # the watchdog holds the marker's lock exclusively only for one flock call

_warned: set[Path] = set()
_held: dict[Path, int] = {}  # home -> the open marker whose shared lock this process holds


def private_home(home: Path) -> Path:
    """``home``, created 0700 when missing; a warning naming it when group or others can use it."""
    try:
        home.mkdir(mode=HOME_MODE)
        os.chmod(home, HOME_MODE)  # mkdir's mode passes through the umask
        return home
    except FileExistsError:
        pass
    except FileNotFoundError:
        home.parent.mkdir(parents=True, exist_ok=True)
        return private_home(home)
    mode = stat.S_IMODE(home.stat().st_mode)
    if mode & 0o077 and home not in _warned:
        _warned.add(home)
        _log.warning("the Prefect home %s is open to other users (mode %o): its prefect.db holds the block "
                     "secrets with their key and %s the local server's password; make it private with "
                     "`chmod 700 %s`", home, mode, AUTH_FILE, home)
    return home


def open_private(path: Path, flags: int) -> int:
    """``os.open`` a file of the home: created 0600, never through a symlink someone planted."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)


def auth_string(home: Path) -> str:
    """The home's auth string, generated (0600) on first use."""
    path = home / AUTH_FILE
    try:
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return _read_auth(path)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(_AUTH_BYTES) + "\n")
    _log.info("generated the local Prefect server's auth string in %s", path)
    return _read_auth(path)


def existing_auth_string(home: Path) -> str | None:
    """The home's auth string, None when it has none yet (no server of Kiln's can be running there)."""
    path = home / AUTH_FILE
    return _read_auth(path) if path.exists() else None


def _read_auth(path: Path) -> str:
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError as exc:
        raise InfrastructureError(f"cannot read the local Prefect server's auth string {path}: {exc}; "
                                  f"remove the file and stop the server (`kiln server stop`) to make a new one"
                                  ) from exc
    with os.fdopen(fd) as handle:
        value = handle.read().strip()
    if not value:
        raise InfrastructureError(f"{path} is empty; remove it and run `kiln server stop` to make a new one")
    return value


def mark_used(home: Path) -> None:
    """Tell the watchdog this process uses the server: touch the marker and hold its lock (shared) until exit."""
    path = home / USED_FILE
    fd = _held.get(home)
    if fd is None:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        for _ in range(_HOLD_ATTEMPTS):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                _held[home] = fd
                break
            except BlockingIOError:
                time.sleep(0.01)
        else:  # the touch below still counts; only the "in use right now" is lost
            os.close(fd)
            fd = -1
    try:
        os.utime(fd if fd >= 0 else path)
    except OSError as exc:
        _log.warning("could not touch %s (the server's idle clock): %s", path, exc)


def in_use(home: Path) -> bool:
    """True while some process holds the marker's shared lock (a command that is using the server)."""
    try:
        fd = open_private(home / USED_FILE, os.O_RDWR | os.O_CREAT)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing releases the exclusive lock it may have got
    return False


def last_used(home: Path, since: float) -> float:
    """When a command last used the server (the marker's mtime; ``since`` when it is older or missing)."""
    try:
        return max(since, (home / USED_FILE).stat().st_mtime)
    except OSError:
        return since
