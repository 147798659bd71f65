"""Small filesystem helpers shared by every layer: atomic writes and hashing."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from kiln.core.errors import InvalidInputError

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


_UMASK = _umask()
_FILE_MODE = 0o666 & ~_UMASK  # what open(path, "w") would have given
_DIR_MODE = 0o777 & ~_UMASK  # what os.mkdir(path) would have given


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` so that readers see the old file or the new one, never half.

    The temporary file lives in the destination directory so that the final
    ``os.replace`` is a rename within one filesystem. ``durable=False`` skips
    the fsync: still atomic for readers, but a crash of the machine may leave
    the file empty — only for copies that can be made again (a run's local
    view of what its record and the build cache hold).
    """
    with staged_write(path, data, durable=durable) as tmp:
        os.replace(tmp, path)


@contextmanager
def staged_write(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> Iterator[str]:
    """A durable temporary copy of ``data`` beside ``path``, for the caller to rename (or link) into place.

    Written and fsynced (unless ``durable=False``) before the block runs, so a
    caller that must hold a lock for the rename (a compare-and-swap) holds it
    only for the rename; removed after the block if it is still there.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp creates 0600 files; an index or a report must be readable by
        # whoever serves or reads it, as a plainly created file would be.
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        yield tmp
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_new_tree(root: str | os.PathLike[str], files: Mapping[str, bytes], *, private: bool = False) -> bool:
    """Create the directory ``root`` holding ``files`` ({relative POSIX path: bytes}) all at once.

    The tree is written into a temporary sibling and renamed into place, so
    readers see no ``root`` (or the empty one) or the whole tree, never part
    of it. One rename instead of an fsync per file: a crash of the machine
    may lose the tree or leave files in it empty, which a re-run of the
    writer repairs (``kiln index`` rewrites every page whose bytes differ).
    Returns False, leaving nothing behind, when ``root`` exists and is not an
    empty directory, or is by the time of the rename: the caller then updates
    it in place. ``private``: the tree's top directory is ``0700`` (this user's alone), not a plain mkdir's.
    """
    root = Path(root)
    if not _absent_or_empty(root):
        return False
    for rel in files:
        if rel.startswith("/") or any(part in ("", ".", "..") for part in rel.split("/")):
            raise InvalidInputError(f"{rel!r} is not a relative path inside {root}")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent)
    renamed = False
    try:
        if not private:
            os.chmod(tmp, _DIR_MODE)  # mkdtemp makes 0700; the tree must be as readable as a plain mkdir's
        _spread_subdirectories(tmp)
        _write_files(tmp, files)
        try:
            os.rename(tmp, root)  # replaces an empty directory; refuses a full one (ENOTEMPTY)
        except OSError as exc:
            log.debug("could not rename %s to %s (%s); the caller writes in place", tmp, root, exc)
            return False
        renamed = True
        return True
    finally:
        if not renamed:
            shutil.rmtree(tmp)


def _write_files(top: str, files: Mapping[str, bytes]) -> None:
    """Every directory first (parents before children), then each file with one open/write/close.

    Plain ``os`` calls on ``str`` paths: the tree is thousands of small
    files, and ``Path`` objects and buffered file objects cost more than the
    writes. O_EXCL because the directory is new: a name given twice is a bug.
    """
    dirs = {rel.rpartition("/")[0] for rel in files}
    dirs.discard("")
    for rel in sorted(dirs):  # parents sort before their children, so each is made once
        os.makedirs(f"{top}/{rel}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for rel, data in files.items():
        fd = os.open(f"{top}/{rel}", flags, 0o666)  # the umask applies, as for open(path, "wb")
        try:
            view, written = memoryview(data), 0
            while written < len(view):
                written += os.write(fd, view[written:])
        finally:
            os.close(fd)


# FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (_IOR/_IOW('f', 1/2, long)) and FS_TOPDIR_FL from linux/fs.h.
_FS_IOC_GETFLAGS = 0x80006601 | struct.calcsize("l") << 16
_FS_IOC_SETFLAGS = 0x40006602 | struct.calcsize("l") << 16
_FS_TOPDIR_FL = 0x00020000


def _spread_subdirectories(directory: str) -> None:
    """Mark ``directory`` as the top of unrelated subtrees for ext2/3/4's Orlov allocator (``chattr +T``).

    Only on a filesystem without a journal, where it pays. Measured there:
    ext4 skips every inode freed in the last minutes, one by one, for each
    new inode of the group, so writing the 100k index (6,000 inodes) right
    after deleting one (``rm -rf out`` before ``kiln index``) took 1.8-4.2 s
    of system time instead of 0.3 s; with the hint, which spreads the project
    directories over the disk's groups away from the freed inodes, 0.55 s.
    The hint's own price is those 0.25 s (Orlov weighs every group for each
    directory), for nothing where a journal means no such scan. Only a hint:
    where the filesystem has no such flag, nothing changes.
    """
    if sys.platform != "linux" or journaled(directory) is not False:
        return
    import fcntl  # POSIX only

    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
        current = struct.unpack_from("i", flags)[0]  # the kernel reads and writes an int, not a long
        if not current & _FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", current | _FS_TOPDIR_FL) + bytes(4))
    except OSError as exc:
        log.debug("no Orlov hint for %s (%s); directories are placed as usual", directory, exc)
    finally:
        os.close(fd)


def journaled(path: str, sysfs: str = "/sys/dev/block", jbd2: str = "/proc/fs/jbd2") -> bool | None:
    """Whether the block device holding ``path`` has a jbd2 journal (ext3/4); None if ``path`` is on no block device.

    jbd2 lists each journal as ``<device>-<journal inode>``; sysfs names the device of a
    ``major:minor``. A filesystem without a block device of its own (tmpfs, overlay, NFS)
    gives None.
    """
    st = os.stat(path)
    try:
        device = os.path.basename(os.readlink(f"{sysfs}/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
    except OSError:
        return None
    try:
        return any(name.rpartition("-")[0] == device for name in os.listdir(jbd2))
    except FileNotFoundError:  # no journal anywhere: jbd2 is not even loaded
        return False


def _absent_or_empty(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


@contextmanager
def polled_lock(path: Path, deadline: float, what: str, error: Callable[[str], Exception], mode: int = 0o600,
                poll_s: float = 0.5) -> Iterator[None]:
    """An exclusive ``fcntl`` lock on ``path`` (created with ``mode``), polled, never blocking past ``deadline``
    (a ``time.monotonic()``); past it, ``error`` with a message naming ``what`` and the lock file. Closing the
    file releases the lock, so a holder that dies releases it too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        logged = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                raise error(f"{what}: another build held {path} past the deadline; if none runs, remove the lock "
                            "file and build again")
            if not logged:
                log.info("%s: waiting for the build that holds %s", what, path)
                logged = True
            time.sleep(poll_s)
        yield
    finally:
        os.close(fd)


def digest(*parts: str) -> str:
    """A stable hash of ordered string parts (for keys and batch ids)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def staged_once(final: Path, marker: str, what: str, make: Callable[[Path], Path], timeout_s: float,
                error: Callable[[str], Exception]) -> Path:
    """``final``, a folder that is whole once it holds ``marker``: made once by ``make(tmp)`` (which returns the
    folder it made under ``tmp``, ``marker`` written last) and renamed into place, one maker at a time (the
    others wait on the lock, then find it). A killed maker's leftovers are removed by the next."""
    if (final / marker).is_file():
        return final
    parent = final.parent
    with polled_lock(parent / f".{final.name}.lock", time.monotonic() + timeout_s, what, error):
        if (final / marker).is_file():
            return final
        for stale in parent.glob(f".{final.name}-*"):  # a killed maker's (the lock says none runs)
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a folder without its marker is a killed rename's remains
        with tempfile.TemporaryDirectory(dir=parent, prefix=f".{final.name}-") as tmp:
            stage = make(Path(tmp))
            os.chmod(stage, 0o755)
            os.replace(stage, final)
    return final
