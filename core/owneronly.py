"""Directories Kiln keeps its own files in (a ``file://`` store's root, ``kiln index --out``): this user's alone.

What lies in such a directory is read back as Kiln's word — run records, the build ledger, the pages an
index serves — so a directory another local user could have written into is no place for it: one owned by
another user, or writable by its group or by everyone, is refused with the reason (:class:`NotOwnerOnlyError`)
before anything is read or written, unless its target says it is shared on purpose (``public``). One Kiln
creates is made ``0700`` (``0755`` when public), and an existing one of this user's that others may read is
closed to ``0700``: run records, wheels and pages are nobody else's to read on a shared machine.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kiln.core.errors import UnsafePathError

OTHERS_WRITE = 0o022


class NotOwnerOnlyError(UnsafePathError):
    """A directory Kiln keeps its own files in is another user's, or others may write into it."""


def check_owner_only(path: Path, what: str, remedy: str) -> None:
    """Refuse ``path`` (``what``, e.g. "the store root") when it exists and another user owns it or may write
    into it; ``remedy``: how to say it is shared on purpose. A missing ``path`` passes (Kiln makes it)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if info.st_uid != me:
        raise NotOwnerOnlyError(f"{what} {path} is refused: it is owned by uid {info.st_uid}, not by this user (uid"
                                f" {me}), so what it holds is not Kiln's word; use a directory of your own, or"
                                f" {remedy}")
    if info.st_mode & OTHERS_WRITE:
        raise NotOwnerOnlyError(f"{what} {path} is refused: its group or every user may write into it (mode"
                                f" {stat.S_IMODE(info.st_mode):04o}), so what it holds is not Kiln's word; check what"
                                f" it holds and `chmod go-w {path}`, or {remedy}")


def owner_only_dir(path: Path, what: str, *, public: bool, remedy: str) -> None:
    """Make ``path`` (with its parents) or check it (:func:`check_owner_only`, unless ``public``), then give it
    its mode: owner-only, or readable and searchable by all when ``public``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o755 if public else 0o700)  # the umask only takes bits away
    except FileExistsError:
        pass
    if not public:
        check_owner_only(path, what, remedy)
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    wanted = (mode | 0o755) if public else (mode & 0o700)
    if wanted != mode and info.st_uid == os.geteuid():
        os.chmod(path, wanted)
