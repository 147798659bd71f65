"""Linux's Landlock through its three system calls: a process restricts itself, and everything it starts after.

Landlock is an allow-list the kernel enforces on the calling process and its descendants, for root too: once
:func:`restrict` returns, a file outside the granted trees cannot be opened, listed, written or executed, no
TCP port can be bound or connected when the kernel handles TCP (ABI 4 and newer), and from ABI 6 no signal
reaches a process outside the domain and no abstract unix socket outside it can be connected. A sandboxed
process also cannot ``ptrace`` (so cannot read ``/proc/<pid>/environ`` or memory of) a process outside its
domain. Rights a kernel does not know are left out, never guessed: :func:`abi` says which it has.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# asm-generic numbers: the same on x86_64 and aarch64
_SYS = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (
    1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12)
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

READ = EXECUTE | READ_FILE | READ_DIR
# the rights that apply to a file (not a directory): a rule on a file may grant only these
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


class LandlockError(OSError):
    """A Landlock call failed (the kernel lacks it, or refused a rule)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(name: str, *args: object) -> int:
    if platform.machine() not in ("x86_64", "aarch64"):
        raise LandlockError(0, f"Landlock's system call numbers are not known for {platform.machine()}")
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    result = int(libc.syscall(ctypes.c_long(_SYS[name]), *args))
    if result < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, f"landlock_{name}: {os.strerror(err)}")
    return result


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (not built in, or disabled at boot)."""
    try:
        return _syscall("create_ruleset", None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except LandlockError:
        return 0


def fs_rights(version: int) -> int:
    """Every filesystem right ABI ``version`` handles."""
    rights = (1 << 13) - 1
    if version >= 2:
        rights |= REFER
    if version >= 3:
        rights |= TRUNCATE
    if version >= 5:
        rights |= IOCTL_DEV
    return rights


@dataclass(frozen=True)
class Rule:
    """``rights`` on ``path`` and everything beneath it."""

    path: Path
    rights: int


def restrict(rules: Iterable[Rule], deny_tcp: bool, version: int) -> None:
    """Restrict this process (and what it starts) to ``rules``; with ``deny_tcp``, no TCP bind or connect.

    A rule whose path does not exist is skipped. Raises :class:`LandlockError` where the kernel refuses.
    """
    handled = fs_rights(version)
    attr = [handled]
    if version >= 4:
        attr.append(NET_BIND_TCP | NET_CONNECT_TCP if deny_tcp else 0)
    if version >= 6:
        attr.append(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    packed = struct.pack(f"={len(attr)}Q", *attr)
    buf = ctypes.create_string_buffer(packed, len(packed))
    ruleset = _syscall("create_ruleset", buf, ctypes.c_size_t(len(packed)), ctypes.c_uint32(0))
    try:
        for rule in rules:
            _add(ruleset, rule, handled)
        if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise LandlockError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        _syscall("restrict_self", ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def _add(ruleset: int, rule: Rule, handled: int) -> None:
    try:
        fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        rights = rule.rights & handled
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            rights &= FILE_RIGHTS
        packed = struct.pack("=Qi", rights, fd)
        buf = ctypes.create_string_buffer(packed, len(packed))
        _syscall("add_rule", ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), buf, ctypes.c_uint32(0))
    finally:
        os.close(fd)


__all__ = ["FILE_RIGHTS", "READ", "LandlockError", "Rule", "abi", "fs_rights", "restrict"]
