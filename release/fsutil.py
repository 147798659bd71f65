"""Small filesystem helpers shared by every layer: atomic writes and hashing."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_CHUNK = 1 << 20


def _default_mode() -> int:
    """0o666 less the process umask: what ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _default_mode()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` so that readers see the old file or the new one, never half.

    The temporary file lives in the destination directory so that the final
    ``os.replace`` is a rename within one filesystem.
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
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
