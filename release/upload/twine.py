"""Send one file to a PyPI-compatible index's legacy upload API, with ``twine``'s command line.

Twine's command line is its stable surface. It runs with a deadline, in an
environment holding only what it needs: the credentials travel as
``TWINE_USERNAME``/``TWINE_PASSWORD`` (never on the command line, never
logged), an empty ``.pypirc`` stands in for the user's, and keyring is off.

An upload is made idempotent by checking the index first, every time
(:func:`send_file`): a retry after a lost answer finds its file there with
the same sha256 and sends nothing. Twine's failures are translated here, once:
no answer, a timeout, 5xx and 429 are retryable
(:class:`~kiln.core.errors.TransientStoreError`, ``ThrottledError``);
401/403 are :class:`~kiln.core.errors.AccessDeniedError`; any other refusal
is :class:`UploadRefusedError` with the server's reason.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.core.errors import (
    AccessDeniedError,
    AlreadyPublishedError,
    IntegrityError,
    PermanentError,
    ThrottledError,
    TransientStoreError,
)
from kiln.core.fsutil import sha256_file
from kiln.core.wheels import open_wheel
from kiln.release.upload.pypi_index import read_index
from kiln.release.upload.pypi_plan import LARGEST_LISTED, Candidate, IndexFile, Member, version_of

log = logging.getLogger(__name__)

UPLOAD_TIMEOUT_S = 1800.0  # a 1 GiB wheel over a slow link; the deadline still ends it
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # rich's colours, should NO_COLOR be ignored
_HTTP_STATUS = re.compile(r"HTTPError: (\d{3})")
_NO_ANSWER = ("ConnectionError", "Connection refused", "Connection reset", "timed out", "Max retries exceeded",
              "RemoteDisconnected", "ConnectionResetError")
_TAIL = 2000

Runner = Callable[..., "subprocess.CompletedProcess[str]"]
Outcome = Literal["added", "present"]


class UploadRefusedError(PermanentError):
    """The index refused the file (HTTP 4xx other than 401/403/429): its reason says why."""


@dataclass(frozen=True)
class IndexCredentials:
    """What the upload API is told; the password (an API token) never appears in a repr or a log."""

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class Endpoint:
    """A PyPI-compatible index: where files are sent and where its simple API is read."""

    name: str
    upload_url: str
    index_url: str
    timeout_s: float = UPLOAD_TIMEOUT_S


def candidate(path: Path) -> Candidate:
    """A file to send: its name, sha256, size and (a wheel's) ten largest members, largest first."""
    largest: tuple[Member, ...] = ()
    if path.name.endswith(".whl"):
        with open_wheel(path.name, path) as archive:
            members = sorted((Member(i.filename, i.file_size) for i in archive.infolist() if not i.is_dir()),
                             key=lambda m: (-m.size, m.name))
        largest = tuple(members[:LARGEST_LISTED])
    return Candidate(path.name, sha256_file(path), path.stat().st_size, largest)


def twine_argv(path: Path, endpoint: Endpoint, config_file: Path) -> list[str]:
    return [sys.executable, "-m", "twine", "upload", "--non-interactive", "--disable-progress-bar",
            "--config-file", str(config_file), "--repository-url", endpoint.upload_url, str(path)]


_IDENTITY_VARS = ("ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL")


def twine_env(credentials: IndexCredentials, base: Mapping[str, str]) -> dict[str, str]:
    """The environment twine runs in: the parent's less every TWINE_* setting and the worker's OIDC identity
    (GitHub's token request, GitLab's ``*_ID_TOKEN``: twine is given a token, it mints none), plus the
    credentials."""
    env = {k: v for k, v in base.items()
           if not k.startswith("TWINE_") and k not in _IDENTITY_VARS and not k.endswith("_ID_TOKEN")}
    env.update(TWINE_USERNAME=credentials.username, TWINE_PASSWORD=credentials.password,
               TWINE_NON_INTERACTIVE="1", PYTHON_KEYRING_BACKEND="keyring.backends.null.Keyring",
               NO_COLOR="1")
    return env


def classify(filename: str, endpoint: Endpoint, output: str) -> Exception:
    """The typed error of a failed twine upload of ``filename``, from what twine printed."""
    output = _ANSI.sub("", output)
    tail = output.strip()[-_TAIL:]
    where = f"uploading {filename} to {endpoint.name} ({endpoint.upload_url})"
    match = _HTTP_STATUS.search(output)
    status = int(match.group(1)) if match else None
    if status == 429:
        return ThrottledError(f"{where}: HTTP 429, the index asks to slow down: {tail}")
    if status is not None and status >= 500:
        return TransientStoreError(f"{where}: HTTP {status}: {tail}")
    if status in (401, 403):
        return AccessDeniedError(f"{where}: HTTP {status}, the credentials were refused (check the API token's"
                                 f" scope and the Secret block that holds it): {tail}")
    if status is not None:
        return UploadRefusedError(f"{where}: the index refused it with HTTP {status}: {tail}")
    if any(marker in output for marker in _NO_ANSWER):
        return TransientStoreError(f"{where}: the index did not answer: {tail}")
    return UploadRefusedError(f"{where}: twine failed: {tail}")


def twine_upload(path: Path, endpoint: Endpoint, credentials: IndexCredentials, runner: Runner = subprocess.run,
                 environ: Mapping[str, str] = os.environ) -> None:
    """Run ``twine upload`` for one file under the endpoint's deadline; a typed error if it fails."""
    with tempfile.TemporaryDirectory(prefix="kiln-twine-") as home:
        config_file = Path(home) / ".pypirc"
        config_file.write_text("[distutils]\nindex-servers =\n")
        argv = twine_argv(path, endpoint, config_file)
        log.info("running %s (deadline %.0f s)", " ".join(argv), endpoint.timeout_s)
        try:
            done = runner(argv, env=twine_env(credentials, {**environ, "HOME": home}), capture_output=True,
                          text=True, timeout=endpoint.timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TransientStoreError(f"uploading {path.name} to {endpoint.name}: twine did not finish within"
                                      f" {endpoint.timeout_s:.0f} s; it was killed") from exc
    if done.returncode != 0:
        raise classify(path.name, endpoint, f"{done.stdout}\n{done.stderr}")


def _held(files: Sequence[IndexFile], filename: str) -> IndexFile | None:
    return next((f for f in files if f.filename == filename), None)


def send_file(path: Path, endpoint: Endpoint, credentials: IndexCredentials, runner: Runner = subprocess.run,
                read: Callable[[str, str], list[IndexFile]] = read_index) -> Outcome:
    """Send ``path`` unless the index holds it; then check the index lists it with its sha256.

    ``present``: the index already held these bytes (nothing sent). AlreadyPublishedError: it holds other
    bytes under the name (published files are immutable). IntegrityError: after the upload the index lists
    other bytes than were sent.
    """
    project = _project(path.name)
    sha256 = sha256_file(path)
    existing = _held(read(endpoint.index_url, project), path.name)
    if existing is not None:
        if existing.sha256 == sha256:
            log.info("%s is already on %s with the same sha256; nothing sent", path.name, endpoint.name)
            return "present"
        raise AlreadyPublishedError.held(f"{endpoint.name}: {path.name}", existing.sha256, sha256)
    twine_upload(path, endpoint, credentials, runner)
    listed = _held(read(endpoint.index_url, project), path.name)
    if listed is None:
        raise TransientStoreError(f"{endpoint.name} accepted {path.name} but its page does not list it yet"
                                  " (an index that updates its pages late); checked again on retry")
    if listed.sha256 != sha256:
        raise IntegrityError(f"{endpoint.name} accepted {path.name} but lists it with sha256 {listed.sha256},"
                             f" not the {sha256} that was sent")
    return "added"


def _project(filename: str) -> str:
    version_of(filename)  # refuses a name that is neither a wheel nor an sdist, naming it
    return filename.split("-", 1)[0] if filename.endswith(".whl") else filename.rsplit("-", 1)[0]

