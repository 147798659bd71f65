"""Upload kinds: what a release sends to an index outside Kiln's own, behind one protocol and one table.

A kind (``kind`` of a ``[publish.targets.<name>]`` table in kiln.toml) is one
implementation of :class:`Uploader`, registered in :data:`UPLOADERS` under
that name. The release reaches a target only through :func:`uploader_for`: it
asks the uploader what the index holds, plans against it (what will be sent,
skipped or refused, before anything moves), then sends each file of the plan,
one call per file, with credentials read or minted inside that call. A new kind
is a module with its implementation and one entry here.

The first kind is ``upload``: a PyPI-compatible index's legacy upload API
(twine, :mod:`kiln.release.upload`), judged by PyPI's rules
(:mod:`kiln.release.pypi_plan`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Protocol

from kiln.core.errors import ConfigError
from kiln.release.pypi_index import read_index
from kiln.release.pypi_plan import IndexFile
from kiln.release.pypi_release import PreparedUpload, UploadRequest, prepare_upload
from kiln.release.upload import Endpoint, IndexCredentials, Outcome, send_file


class Uploader(Protocol):
    """One upload kind. Every method is safe to retry: a send checks the index before and after."""

    def holds(self, index_url: str, project: str) -> list[IndexFile]:
        """What the index already holds of ``project``."""
        ...

    def plan(self, request: UploadRequest, out_dir: Path, now: datetime) -> PreparedUpload:
        """The files of ``request`` written as the index gets them (in ``out_dir``), judged against what it holds."""
        ...

    def send(self, path: Path, endpoint: Endpoint, credentials: IndexCredentials) -> Outcome:
        """Send one planned file unless the index holds it (``present``); then check it lists these bytes."""
        ...


class PyPIUploader:
    """A PyPI-compatible index: public-version wheels (and an sdist) sent through twine."""

    def holds(self, index_url: str, project: str) -> list[IndexFile]:
        return read_index(index_url, project)

    def plan(self, request: UploadRequest, out_dir: Path, now: datetime) -> PreparedUpload:
        return prepare_upload(request, out_dir, now, self.holds)

    def send(self, path: Path, endpoint: Endpoint, credentials: IndexCredentials) -> Outcome:
        return send_file(path, endpoint, credentials, read=self.holds)


# kind (as kiln.toml spells it) -> its uploader. A new kind: its module, and one entry here.
UPLOADERS: dict[str, Uploader] = {"upload": PyPIUploader()}


def uploader_for(kind: str) -> Uploader:
    """The uploader of ``kind``; ConfigError naming the kind and the known ones otherwise."""
    try:
        return UPLOADERS[kind]
    except KeyError:
        raise ConfigError(f"upload kind {kind!r} has no uploader; the kinds are {sorted(UPLOADERS)}") from None


__all__ = ["UPLOADERS", "PyPIUploader", "Uploader", "uploader_for"]
