"""Storage backends behind one small protocol: a local directory and S3.

A store holds objects under POSIX keys relative to its root (a directory, or
an S3 ``bucket/prefix``). Two kinds of writes exist, and nothing else:

* :meth:`Store.put_immutable` (bytes) and :meth:`Store.put_immutable_file`
  (a file, streamed) — create-only. Writing the same bytes again is
  success (so a re-run after a crash is harmless; the returned
  :attr:`ObjectInfo.created` is then False); other bytes under an existing key
  raise :class:`~kiln.core.errors.AlreadyPublishedError`. Wheels are written
  from their files, never read whole into memory: the caller passes the hash it
  streamed, and the store checks that what it wrote has that hash
  (:class:`~kiln.core.errors.IntegrityError` for a file changed in between).
  Metadata sidecars and benchmark results are written from bytes.
* :meth:`Store.put_page` — compare-and-swap on the ETag read earlier
  (``expected_etag=None`` means "the key must not exist yet"). A lost race
  raises :class:`~kiln.core.errors.ConflictError`; the caller re-reads, re-merges
  and retries. Index pages and history files are written this way.

The protocol has no delete: nothing that publishes may remove a published
object. The local and S3 stores have a ``delete`` beside it that only a
prune calls (:mod:`kiln.release.publish.prune`, its own credentials).

The protocol itself (:class:`Store`, :class:`ObjectInfo`, :func:`check_key`) is
:mod:`kiln.core.objects`, re-exported here. Backends register themselves
by URL scheme in :data:`BACKENDS` (a :class:`StoreBackend` each); the S3 one
lives in :mod:`kiln.core.s3` and is imported only when an ``s3://`` URL is
opened. Code outside the store layer asks the table about a URL
(:func:`backend_for`, :func:`is_remote`) rather than testing its scheme, so a
new kind of store is its module and one entry in the table. ``file://`` URLs
are resolved against ``root`` unless absolute (``file:///abs/dir``).

The local store keeps no content type, no ``Cache-Control`` and no metadata: a
file has no headers, so the ``content_type`` and ``cache_control`` its writes
are given are dropped (an HTTP server in front derives the type from the
extension, see :mod:`kiln.release.read.serve`, and its caching is that server's
configuration); its ETag is the SHA-256 of the content,
and its compare-and-swap holds an ``flock`` on the key's directory so two
processes publishing into the same directory serialise their page updates.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.errors import AlreadyPublishedError, ConflictError, IntegrityError, InvalidInputError, UnsafePathError
from kiln.core.fsutil import sha256_bytes, sha256_file
from kiln.core.nofollow import Staged, open_directory, staged, staged_copy
from kiln.core.objects import BotoSession, ObjectInfo, Store, check_key
from kiln.core.owneronly import check_owner_only, owner_only_dir

log = logging.getLogger(__name__)
PUBLIC_REMEDY = "set `public = true` on its target in kiln.toml if it is shared on purpose"


class LocalStore:
    """A directory on a local filesystem; every write is atomic (temp file + rename/link).

    Writes never go through a symbolic link below the root (:mod:`kiln.core.nofollow`);
    reads may follow one only while it stays inside the root.

    Owner-only unless ``public``: the first write makes the root directory ``0700`` (run records,
    wheels and pages are nobody else's to read on a shared machine); a ``public`` store (an index
    another user's web server serves) keeps its root readable and searchable by all (``0755``).
    A root another user owns, or that others may write into, is refused before the first read or
    write (:mod:`kiln.core.owneronly`): what it holds would not be Kiln's word.
    """

    def __init__(self, root: Path, public: bool = False) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()
        self.public = public
        self._prepared = False
        self._checked = False

    def _prepare(self) -> None:
        """Create the root with the store's mode, or check it and set that mode on a root this user owns."""
        if self._prepared:
            return
        owner_only_dir(self.root, "the store root", public=self.public, remedy=PUBLIC_REMEDY)
        self._prepared = self._checked = True

    def _check_root(self) -> None:
        """Refuse a root another user owns or may write into: a read trusts it as much as a write does."""
        if not (self._checked or self.public):
            check_owner_only(self.root, "the store root", PUBLIC_REMEDY)
            self._checked = self.root.exists()  # a root made later is checked by its first write

    def _path(self, key: str) -> Path:
        self._check_root()
        return self.root.joinpath(*check_key(key).split("/"))

    def _inside(self, key: str) -> Path:
        """The file of ``key`` with every link resolved; UnsafePathError when that leaves the root."""
        path = self._path(key)
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root):
            raise UnsafePathError(f"{path} leads to {resolved}, outside the store {self.root} (through a symbolic"
                                  " link); refused: a store reads only its own files")
        return resolved

    def get(self, key: str) -> bytes | None:
        try:
            return self._inside(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def get_page(self, key: str) -> tuple[bytes, str] | None:
        data = self.get(key)
        return None if data is None else (data, sha256_bytes(data))

    def head(self, key: str) -> ObjectInfo | None:
        path = self._inside(key)
        if not path.is_file():
            return None
        digest = sha256_file(path)
        return ObjectInfo(key, path.stat().st_size, digest, digest)

    def put_immutable(self, key: str, data: bytes, content_type: str, cache_control: str) -> ObjectInfo:
        self._prepare()
        digest = sha256_bytes(data)
        with staged(self.root, self._path(key), data) as tmp:
            return self._create(tmp, key, digest, len(data))

    def put_immutable_file(
        self, key: str, path: Path, sha256: str, content_type: str, cache_control: str
    ) -> ObjectInfo:
        self._prepare()
        with staged_copy(self.root, self._path(key), path) as (tmp, digest, size):
            if digest != sha256:  # checked on the copy itself: what is linked is what was hashed
                raise IntegrityError(
                    f"{path} has sha256 {digest} as copied, not the {sha256} it was hashed as: it changed while being"
                    f" published; nothing was written to {self.url}/{key}. Rebuild it, never publish it")
            return self._create(tmp, key, digest, size)

    def _create(self, tmp: Staged, key: str, digest: str, size: int) -> ObjectInfo:
        """Link the staged file in as ``key`` unless it exists; existing other bytes are AlreadyPublishedError."""
        # link() fails if the target exists, which makes create-only atomic
        # even against another process writing the same key.
        try:
            tmp.link()
            log.debug("created %s/%s (%d bytes)", self.url, key, size)
            created = True
        except FileExistsError:
            existing = tmp.current_sha256()
            if existing != digest:
                raise AlreadyPublishedError.held(f"{self.url}/{key}", existing, digest) from None
            created = False
        return ObjectInfo(key, size, digest, digest, created)

    def put_page(
        self, key: str, data: bytes, content_type: str, cache_control: str, expected_etag: str | None
    ) -> ObjectInfo:
        self._prepare()
        path = self._path(key)
        # Written and fsynced before the lock: writers of other keys in the directory wait only for a rename.
        with staged(self.root, path, data) as tmp, _dir_lock(tmp.dir_fd):
            current = tmp.current()
            current_etag = None if current is None else sha256_bytes(current)
            if current_etag != expected_etag:
                raise ConflictError(
                    f"{self.url}/{key} changed since it was read (ETag {expected_etag!r} -> {current_etag!r})"
                )
            tmp.replace()
        digest = sha256_bytes(data)
        return ObjectInfo(key, len(data), digest, digest)

    def delete(self, key: str) -> None:
        """Remove ``key``; gone already is success. Only a prune deletes (:mod:`kiln.release.publish.prune`); no
        link below the root is followed. Directories stay: a publisher may be writing into one."""
        parts = check_key(key).split("/")
        self._check_root()
        try:
            with open_directory(self.root, parts[:-1]) as dir_fd:
                os.unlink(parts[-1], dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            return
        log.debug("deleted %s/%s", self.url, key)

    def list(self, prefix: str = "") -> list[str]:
        self._check_root()
        keys: list[str] = []
        # Only the directory the prefix names (or the one its last part is in): a run's record is
        # listed in the time its own files take, however many runs the store holds.
        start = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root.joinpath(*start.split("/")) if start else self.root
        if start and any(part.startswith(".") or part in ("", "..") for part in start.split("/")):
            top = self.root  # not a key's directory: the full walk below filters it out
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if rel == "." else rel + "/"
            keys.extend(base + name for name in filenames if not name.startswith("."))
        return sorted(k for k in keys if k.startswith(prefix))


@contextmanager
def _dir_lock(dir_fd: int) -> Iterator[None]:
    """An exclusive advisory lock on an open directory (released when the block ends or the process dies)."""
    fcntl.flock(dir_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)


# Any: the S3-only options, ignored by a local store
def _open_local(url: str, *, root: Path, public: bool = False, **_: Any) -> Store:
    path = url[len("file://"):]
    if not path:
        raise InvalidInputError(f"store URL {url!r} names no directory")
    if any(ord(ch) < 32 for ch in path):
        raise InvalidInputError(f"store URL {url!r} contains a control character")
    return LocalStore(Path(path) if path.startswith("/") else Path(root) / path, public)


# Any: open_s3_store's keyword arguments, passed on as they are
def _open_s3(url: str, *, public: bool = False, **kwargs: Any) -> Store:
    # ``public`` is a file:// setting: who reads an S3 prefix is the bucket policy's business.
    from kiln.core.s3 import open_s3_store  # boto3 is imported only when S3 is used

    return open_s3_store(url, **kwargs)


@dataclass(frozen=True)
class StoreBackend:
    """One kind of store, by the scheme of its URLs."""

    scheme: str
    open: Callable[..., Store]  # (url, *, root, public, and the remote options of open_store) -> the store
    # A service each step reaches with credentials of its own, its rights granted by generated access policies
    # (S3 and IAM); a local directory is reached with the process's file permissions and needs neither.
    remote: bool


BACKENDS: dict[str, StoreBackend] = {
    backend.scheme: backend for backend in (StoreBackend("file", _open_local, remote=False),
                                            StoreBackend("s3", _open_s3, remote=True))}


def scheme_of(url: str) -> str:
    """The scheme of a store URL (``s3`` of ``s3://bucket/prefix``); "" when it has none."""
    return url.split("://", 1)[0] if "://" in url else ""


def backend_for(url: str) -> StoreBackend:
    """The backend of a store URL; InvalidInputError naming the URL and the schemes there are otherwise."""
    backend = BACKENDS.get(scheme_of(url))
    if backend is None:
        raise InvalidInputError(f"store URL {url!r}: scheme must be one of {sorted(s + '://' for s in BACKENDS)}")
    return backend


def is_remote(url: str) -> bool:
    """Whether ``url`` names a remote store (a step reaches it with its own credentials); False for any URL
    that is not a store's (an http(s) index, a plain path)."""
    backend = BACKENDS.get(scheme_of(url))
    return backend is not None and backend.remote


def open_store(
    url: str,
    *,
    root: Path,
    region: str | None = None,
    endpoint: str | None = None,
    expected_owner: str | None = None,
    session: BotoSession | None = None,
    verifies_checksums: bool | None = None,
    public: bool = False,
) -> Store:
    """Open the store a ``file://`` or ``s3://`` URL names.

    ``root`` anchors relative ``file://`` paths (normally the directory of
    ``kiln.toml`` or the run directory); S3 options are ignored by the local
    backend. ``session`` is a ``boto3.Session`` holding the step's credentials.
    ``verifies_checksums``: whether the S3 server checks the ``ChecksumSHA256``
    it is sent (None: true on AWS, false on a custom ``endpoint``), see
    :mod:`kiln.core.s3`. ``public``: a ``file://`` store readable by every local user (else owner-only).
    """
    return backend_for(url).open(
        url, root=Path(root), region=region, endpoint=endpoint, expected_owner=expected_owner, session=session,
        verifies_checksums=verifies_checksums, public=public,
    )


__all__ = [
    "BACKENDS", "LocalStore", "ObjectInfo", "Store", "StoreBackend", "backend_for", "check_key", "is_remote",
    "open_store", "scheme_of",
]
