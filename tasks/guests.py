"""How a step starts package code: one call for the command line and one for the environment.

Every process that runs the package's or a third party's code — a test worker, a benchmark's measuring
process, a build backend, a compile worker, an sdist hook — is started as ``guest_command(...)`` with
``guest_environ(...)`` (:mod:`kiln.core.sandbox` says what they mean): it reads the interpreter it runs,
Kiln's own code and the trees named here, writes only the directories named here, and has the network it is
given (``"none"`` for builds, ``"loopback"``, its own, for tests and benchmarks).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from kiln.core.sandbox import Network, Policy, guest_env, interpreter_trees, kiln_trees, wrap


def guest_command(cmd: Sequence[str], *, read: Iterable[str | os.PathLike[str]] = (),
                  write: Iterable[str | os.PathLike[str]] = (), network: Network) -> list[str]:
    """``cmd`` (its first word an interpreter or a program) inside the sandbox: read ``read``, the interpreter's
    trees and Kiln's code; write ``write``."""
    trees = kiln_trees() | {str(Path(p)) for p in read}
    if cmd and Path(cmd[0]).is_absolute():
        trees |= interpreter_trees(cmd[0]) if Path(cmd[0]).name.startswith("python") else {str(Path(cmd[0]).parent)}
    policy = Policy(read=tuple(sorted(trees)), write=tuple(sorted({str(Path(p)) for p in write})), network=network)
    return wrap(cmd, policy)


def guest_environ(home: Path, extra: Mapping[str, str] | None = None, pass_env: Iterable[str] = (),
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment of a guest: of ``base`` (default: this process's) plus ``extra``, with a
    private ``HOME``/``TMPDIR`` at ``home``."""
    return guest_env({**(os.environ if base is None else base), **(extra or {})}, home, pass_env)


__all__ = ["guest_command", "guest_environ"]
