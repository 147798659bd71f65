"""A build unit's compile seconds: spent now, and saved by the caches (no Prefect here).

ccache records no compile time, so Kiln measures each unit's build when it runs and keeps the time in the unit
cache's entry (its ``info``, in both tiers; :mod:`kiln.tasks.build.cache`). The rules:

- a unit-cache hit spent 0 s and saved the entry's ``full_compile_s``, what a compile of every translation unit
  of that unit took; an entry without it (written before seconds were recorded, or whose basis was unknown)
  saved an unknown amount, shown as n/a;
- a compile in which no translation unit came from the compile cache (and a unit without translation units:
  Triton) spent its measured time and saved 0 s; that time is the entry's full-compile seconds, and the unit's
  last full compile on this worker (:meth:`~kiln.tasks.build.cache.BuildCache.note_full_compile`);
- a partial compile (some translation units served by the compile cache) spent its measured time and saved an
  estimate: the unit's last full compile on this worker minus what it spent, floored at 0 (its sources changed
  since, but compiling them all costs about what it did then); with no full compile recorded here, n/a. Its
  entry carries that full-compile time forward, so a later hit on it counts a full compile saved, not the
  partial's few seconds.

The time measured is the unit's builder alone: the variant's build environment is made before the clock starts.
A pep517 unit's time is its whole backend build (its build requirements installed in isolation, the compile, the
wheel packed), so it is more than its compilers' share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SPENT = "compile_s"  # an entry's info: the seconds its own compile took
FULL = "full_compile_s"  # an entry's info: the seconds a compile of every translation unit of the unit takes


@dataclass(frozen=True)
class CompileSeconds:
    """One unit's compile seconds in this build: ``saved`` is None when there is no basis to say."""

    spent: float = 0.0
    saved: float | None = 0.0


def measured(seconds: float) -> float:
    """A measured wall time as it is recorded and reported (milliseconds: the entry, the hit and the summary
    then show the same number)."""
    return round(max(seconds, 0.0), 3)


def on_hit(info: Mapping[str, object]) -> CompileSeconds:
    """A unit-cache hit on an entry with ``info``: nothing spent, its recorded full compile saved."""
    return CompileSeconds(0.0, recorded(info))


def recorded(info: Mapping[str, object]) -> float | None:
    """The full-compile seconds an entry's ``info`` records; None for an entry without a usable one."""
    value = info.get(FULL)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)


def on_compile(spent: float, partial: bool, last_full: float | None) -> tuple[CompileSeconds, float | None]:
    """A compile that took ``spent`` seconds; ``partial`` when the compile cache served some of its translation
    units, ``last_full`` the unit's last full compile here. Returns its seconds and the full-compile seconds its
    entry records (None: unknown)."""
    if not partial:
        return CompileSeconds(spent, 0.0), spent
    if last_full is None:
        return CompileSeconds(spent, None), None
    return CompileSeconds(spent, measured(last_full - spent)), last_full


def entry_info(spent: float, full: float | None) -> dict[str, object]:
    """What a compiled unit's entry records of its seconds."""
    info: dict[str, object] = {SPENT: spent}
    if full is not None:
        info[FULL] = full
    return info


@dataclass(frozen=True)
class SecondsTotal:
    spent: float
    saved: float
    unknown: int  # units whose saved seconds have no basis (n/a)
    units: int

    def describe(self) -> str:
        """``compile seconds spent S, saved V``; units without a basis are named, never counted as 0."""
        if self.units and self.unknown == self.units:
            saved = "n/a"
        else:
            saved = f"{self.saved:.1f}" + (f" (n/a for {self.unknown} units)" if self.unknown else "")
        return f"compile seconds spent {self.spent:.1f}, saved {saved}"


def total(seconds: Iterable[CompileSeconds]) -> SecondsTotal:
    every = list(seconds)
    return SecondsTotal(sum(s.spent for s in every), sum(s.saved or 0.0 for s in every),
                        sum(s.saved is None for s in every), len(every))
