"""Upload kinds: what a release sends to an index outside Kiln's own, behind one protocol and one table.

A kind (``kind`` of a ``[publish.targets.<name>]`` table in kiln.toml) is one
implementation of :class:`Uploader`, registered in :data:`UPLOADERS` under
that name. The release reaches a target only through :func:`uploader_for`: it
asks the uploader what the index holds, plans against it (what will be sent,
skipped or refused, before anything moves), then sends each file of the plan,
one call per file, with credentials the uploader reads or mints inside that call
(:meth:`Uploader.credentials`: a secret is never a flow or task parameter). A
new kind is a module with its implementation and its target's config model,
and one entry in :data:`kiln.release.upload.kinds.UPLOAD_KINDS`, the table
kiln.toml's loader validates targets by without importing any implementation;
:data:`UPLOADERS` makes each kind's uploader from that entry on first use.

The first kind is ``upload``: a PyPI-compatible index's legacy upload API
(twine, :mod:`kiln.release.upload.twine`), judged by PyPI's rules
(:mod:`kiln.release.upload.pypi_plan`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from kiln.core import identity
from kiln.core.errors import ConfigError
from kiln.release.upload import trusted_publishing
from kiln.release.upload.kinds import UPLOAD_KINDS, UploadKind, UploadTargetConfig, load
from kiln.release.upload.pypi_index import read_index
from kiln.release.upload.pypi_plan import IndexFile
from kiln.release.upload.pypi_release import PreparedUpload, UploadRequest, prepare_upload
from kiln.release.upload.twine import Endpoint, IndexCredentials, Outcome, send_file


@runtime_checkable
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

    def credentials(self, target: UploadTargetConfig, name: str, secret: Callable[[str], str]) -> IndexCredentials:
        """The credentials of one send to ``target`` (``[publish.targets.<name>]``), read or minted now.

        Called inside the upload task run, once per send, so a secret is never a flow or task parameter and a
        minted token lives for that send alone. ``secret`` reads a Prefect Secret block by name (injected)."""
        ...


@runtime_checkable
class PyPITargetConfig(UploadTargetConfig, Protocol):
    """Where a PyPI-compatible index's credentials come from: an API token's Secret block, or the worker's OIDC
    identity exchanged at the index (Trusted Publishing). kiln.toml's ``upload`` kind has these keys."""

    @property
    def token_block(self) -> str | None: ...
    @property
    def trusted_publishing(self) -> bool: ...
    @property
    def oidc_url(self) -> str | None: ...
    @property
    def username(self) -> str: ...


class PyPIUploader:
    """A PyPI-compatible index: public-version wheels (and an sdist) sent through twine."""

    def holds(self, index_url: str, project: str) -> list[IndexFile]:
        return read_index(index_url, project)

    def plan(self, request: UploadRequest, out_dir: Path, now: datetime) -> PreparedUpload:
        return prepare_upload(request, out_dir, now, self.holds)

    def send(self, path: Path, endpoint: Endpoint, credentials: IndexCredentials) -> Outcome:
        return send_file(path, endpoint, credentials, read=self.holds)

    def credentials(self, target: UploadTargetConfig, name: str, secret: Callable[[str], str]) -> IndexCredentials:
        """A token minted from the worker's identity, or the API token ``secret`` reads from the target's block."""
        if not isinstance(target, PyPITargetConfig):
            raise ConfigError(f"publish.targets.{name}: a {target.kind!r} target has no token_block nor"
                              " trusted_publishing key, which a PyPI-compatible index's upload needs")
        if target.trusted_publishing:
            with identity.exposed():  # the CI's identity is in the environment for this exchange alone
                return trusted_publishing.mint_credentials(oidc_base(target))
        if target.token_block is None:
            raise ConfigError(f"publish.targets.{name}: no token_block and trusted_publishing is off")
        return IndexCredentials(target.username, secret(target.token_block))


def oidc_base(target: PyPITargetConfig) -> str:
    """Where ``target``'s index serves Trusted Publishing's ``/_/oidc/…`` exchange."""
    return trusted_publishing.oidc_base(target.url, target.oidc_url)


class _Uploaders(Mapping[str, Uploader]):
    """The kinds of ``kinds``, each uploader made from its entry's ``uploader`` when first asked for.

    An entry that changes (a test registering its fake, then removing it) is made again from its new value.
    One lock: uploads run in task threads, and a kind's uploader is one object however many ask at once."""

    def __init__(self, kinds: Mapping[str, UploadKind]) -> None:
        self._kinds = kinds
        self._made: dict[str, tuple[str, Uploader]] = {}
        self._lock = threading.Lock()

    def __getitem__(self, kind: str) -> Uploader:
        spec = self._kinds[kind].uploader
        with self._lock:
            made = self._made.get(kind)
            if made is None or made[0] != spec:
                made = (spec, _make(kind, spec))
                self._made[kind] = made
            return made[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


def _make(kind: str, spec: str) -> Uploader:
    try:
        factory = load(spec)
    except ValueError as exc:
        raise ConfigError(f"upload kind {kind!r}: {exc}") from exc
    made = factory() if callable(factory) else None
    if not isinstance(made, Uploader):  # every method, credentials included: a kind missing one fails here
        raise ConfigError(f"upload kind {kind!r}: {spec!r} makes no Uploader (a class with holds, plan, send"
                          " and credentials)")
    return made


# kind (as kiln.toml spells it) -> its uploader, made from its entry in UPLOAD_KINDS when first asked for.
UPLOADERS: Mapping[str, Uploader] = _Uploaders(UPLOAD_KINDS)


def uploader_for(kind: str) -> Uploader:
    """The uploader of ``kind``; ConfigError naming the kind and the known ones otherwise."""
    try:
        return UPLOADERS[kind]
    except KeyError:
        raise ConfigError(f"upload kind {kind!r} has no uploader; the kinds are {sorted(UPLOADERS)}") from None


__all__ = ["UPLOADERS", "PyPITargetConfig", "PyPIUploader", "Uploader", "oidc_base", "uploader_for"]
