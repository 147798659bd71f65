"""Writes and reads under a root directory that never go through a symbolic link below it.

An index directory (``kiln index --out``) or a local store is a tree that
other people's tools may also touch. A symbolic link planted below its root
(``out/demo -> ../outside``) would make a plain ``open(root / rel)`` write
outside the tree. Here every directory below the root is opened with
``O_NOFOLLOW`` relative to its parent's descriptor (``dir_fd``), and files are
created, renamed and linked relative to the last one, so no path is looked up
twice and a link swapped in between two checks is still refused. The root
itself may be a link: that is the caller's choice of where the tree lives.

Refusals are :class:`~kiln.core.errors.UnsafePathError` naming the link.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import UnsafePathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


def relative_parts(root: Path, path: Path) -> list[str]:
    """The components of ``path`` below ``root`` (compared as written, not resolved); refuses '..' and escapes."""
    try:
        parts = list(Path(path).relative_to(root).parts)
    except ValueError:
        raise UnsafePathError(f"{path} is not inside {root}") from None
    if not parts or any(part in ("", ".", "..") for part in parts):
        raise UnsafePathError(f"{path} does not name a file inside {root}")
    return parts


def _refusal(root: Path, parts: Sequence[str]) -> UnsafePathError:
    where = root.joinpath(*parts)
    try:
        target = os.readlink(where)
    except OSError:
        target = "?"
    return UnsafePathError(f"{where} is a symbolic link (to {target}) under {root}; Kiln never writes or reads"
                           " through a link below its root. Remove the link, or give a directory without one")


def _open_child(fd: int, root: Path, parts: Sequence[str], create: bool) -> int:
    name = parts[-1]
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and is_link(fd, name):
            raise _refusal(root, parts) from None
        raise
    try:
        os.mkdir(name, 0o777, dir_fd=fd)  # the umask applies, as for a plain mkdir
    except FileExistsError:
        pass  # made by another writer meanwhile; opened without following below all the same
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and is_link(fd, name):
            raise _refusal(root, parts) from None
        raise


def is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


@contextmanager
def open_directory(root: Path, parts: Sequence[str], create: bool = False) -> Iterator[int]:
    """A descriptor of ``root/parts...``, each part opened without following a link (made when ``create``)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth in range(len(parts)):
            child = _open_child(fd, root, parts[: depth + 1], create)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def check_no_links(root: Path, path: Path) -> None:
    """UnsafePathError when a component of ``path`` below ``root`` (the file itself included) is a link."""
    parts = relative_parts(root, path)
    try:
        with open_directory(root, parts[:-1]) as fd:
            if is_link(fd, parts[-1]):
                raise _refusal(root, parts)
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there yet: nothing to follow


def _by_directory(rels: Sequence[str]) -> dict[tuple[str, ...], list[str]]:
    groups: dict[tuple[str, ...], list[str]] = {}
    for rel in rels:
        parts = rel.split("/")
        if rel.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise UnsafePathError(f"{rel!r} is not a relative path inside the tree")
        groups.setdefault(tuple(parts[:-1]), []).append(rel)
    return groups


def read_files(root: Path, rels: Sequence[str]) -> dict[str, bytes | None]:
    """{rel: bytes, or None when absent} for relative POSIX paths below ``root``, no link below it followed.

    Each directory is opened once for all of its files.
    """
    found: dict[str, bytes | None] = {}
    for directory, members in _by_directory(rels).items():
        try:
            with open_directory(root, directory) as fd:
                for rel in members:
                    found[rel] = read_at(fd, rel.rpartition("/")[2], root, rel.split("/"))
        except (FileNotFoundError, NotADirectoryError):
            found.update(dict.fromkeys(members))
    return found


def check_tree(root: Path, rels: Sequence[str]) -> None:
    """UnsafePathError naming the first link found on the way to any of ``rels`` (files included)."""
    for directory, members in _by_directory(rels).items():
        try:
            with open_directory(root, directory) as fd:
                for rel in members:
                    if is_link(fd, rel.rpartition("/")[2]):
                        raise _refusal(root, rel.split("/"))
        except (FileNotFoundError, NotADirectoryError):
            continue


def read_file(root: Path, path: Path) -> bytes | None:
    """The bytes of ``path`` below ``root`` read without following any link below ``root``; None if absent."""
    parts = relative_parts(root, path)
    try:
        with open_directory(root, parts[:-1]) as fd:
            return read_at(fd, parts[-1], root, parts)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _open_at(dir_fd: int, name: str, root: Path, parts: Sequence[str]) -> int | None:
    """``name`` in ``dir_fd`` opened for reading without following a link (refused, naming it); None if absent."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refusal(root, parts) from None
        raise


def read_at(dir_fd: int, name: str, root: Path, parts: Sequence[str]) -> bytes | None:
    fd = _open_at(dir_fd, name, root, parts)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def file_sha256(root: Path, path: Path) -> str | None:
    """Hex SHA-256 of ``path`` below ``root``, streamed, no link below ``root`` followed; None if absent."""
    parts = relative_parts(root, path)
    try:
        with open_directory(root, parts[:-1]) as fd:
            return sha256_at(fd, parts[-1], root, parts)
    except (FileNotFoundError, NotADirectoryError):
        return None


def sha256_at(dir_fd: int, name: str, root: Path, parts: Sequence[str]) -> str | None:
    """Hex SHA-256 of ``name`` in ``dir_fd`` read streaming without following a link; None if absent."""
    fd = _open_at(dir_fd, name, root, parts)
    if fd is None:
        return None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Staged:
    """A written temporary file beside ``name`` in the directory ``dir_fd``, ready to be renamed or linked."""

    dir_fd: int
    tmp: str
    name: str
    root: Path
    parts: tuple[str, ...]

    def replace(self) -> None:
        os.replace(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def link(self) -> None:
        """Create ``name`` as a hard link of the temporary file; FileExistsError when it exists."""
        os.link(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd, follow_symlinks=False)

    def current(self) -> bytes | None:
        return read_at(self.dir_fd, self.name, self.root, self.parts)

    def current_sha256(self) -> str | None:
        return sha256_at(self.dir_fd, self.name, self.root, self.parts)


def _write_all(fd: int, data: bytes) -> None:
    view, written = memoryview(data), 0
    while written < len(view):
        written += os.write(fd, view[written:])


@contextmanager
def _staging(root: Path, path: Path, fill: Callable[[int], None], durable: bool) -> Iterator[Staged]:
    """A temporary file beside ``path`` that ``fill`` writes to (given its descriptor); see :func:`staged`."""
    parts = relative_parts(root, path)
    Path(root).mkdir(parents=True, exist_ok=True)  # the root and above: the caller's choice, links included
    with open_directory(root, parts[:-1], create=True) as dir_fd:
        if is_link(dir_fd, parts[-1]):
            raise _refusal(root, parts)
        tmp = f".{parts[-1]}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
        try:
            try:
                fill(fd)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            yield Staged(dir_fd, tmp, parts[-1], root, tuple(parts))
        finally:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def staged(root: Path, path: Path, data: bytes, *, durable: bool = True) -> AbstractContextManager[Staged]:
    """``data`` written to a temporary file beside ``path`` (below ``root``, no link followed on the way).

    Missing directories are made. A link at ``path`` itself is refused too: a
    rename would replace the link, but whoever reads the old one would not.
    The temporary file is removed after the block if it is still there.
    """
    return _staging(root, path, lambda fd: _write_all(fd, data), durable)


@contextmanager
def staged_copy(root: Path, path: Path, source: Path) -> Iterator[tuple[Staged, str, int]]:
    """A durable copy of the file ``source`` staged as :func:`staged` stages bytes, streamed (never read whole),
    with the hex SHA-256 and size of the bytes the copy holds, hashed as they were written."""
    digest, size = hashlib.sha256(), 0

    def fill(fd: int) -> None:
        nonlocal size
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
            size += len(block)
            _write_all(fd, block)

    with open(source, "rb") as handle, _staging(root, path, fill, durable=True) as tmp:
        yield tmp, digest.hexdigest(), size


def write_file(root: Path, path: Path, data: bytes, *, durable: bool = True) -> None:
    """Atomically replace ``path`` below ``root`` with ``data``, refusing any link below ``root``."""
    with staged(root, path, data, durable=durable) as tmp:
        tmp.replace()


def copy_file(root: Path, source: Path, path: Path) -> None:
    """Atomically put a copy of ``source`` at ``path`` below ``root`` (streamed, never read whole)."""
    with staged_copy(root, path, source) as (tmp, _, _):
        tmp.replace()
