"""What the isolation runner runs: its options, the collected items and the jobs made of them.

Its own module because both the runner (:mod:`kiln.tasks.testing.runner`) and the
processes it drives (:mod:`kiln.tasks.testing.workers`) need these types, and the
runner imports the workers: shared types below both keep the import graph acyclic.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from kiln.core.errors import InvalidInputError
from kiln.tasks.testing.classify import TestResult

Isolation = Literal["test", "file"]
StartMethod = Literal["forkserver", "spawn"]
ISOLATIONS: tuple[Isolation, ...] = get_args(Isolation)
START_METHODS: tuple[StartMethod, ...] = get_args(StartMethod)


# Imported once by the fork server so no test pays for them. The last two are
# imported lazily, by the first custom op / torch.compile call and the first
# Triton launch: together seconds per process, i.e. per test.
PRELOAD: tuple[str, ...] = ("torch", "triton", "torch._dynamo", "triton.experimental.gluon")


@dataclass(frozen=True)
class Picked:
    """Which of a suite's collected tests this run runs, and the results it reports for others without running
    them (a pass carried from an earlier run whose inputs are unchanged). A collected test in neither belongs to
    another unit (another shard of the suite) and is not reported here."""

    run: tuple[str, ...]
    settled: tuple[TestResult, ...] = ()


# Given the collected node ids in collection order, what to run of them: test selection and sharding decide
# after collection, because only then are the suite's tests known.
Picker = Callable[[Sequence[str]], Picked]


@dataclass(frozen=True)
class RunOptions:
    isolate: Isolation = "test"
    start: StartMethod = "forkserver"
    timeout_s: float = 300.0          # per test
    grace_s: float = 2.0
    retries: int = 1                  # extra attempts for infrastructure failures only
    markers: str = ""
    pytest_args: tuple[str, ...] = ()
    gpus: int | None = None           # devices this run may use; None: detect
    parallel: int = 1                 # CPU-only jobs at once
    env: Mapping[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = PRELOAD
    collect_timeout_s: float = 600.0
    startup_timeout_s: float = 120.0  # a spawned job's interpreter start and collection
    python: str = sys.executable      # the interpreter of the environment under test
    pass_env: tuple[str, ...] = ()    # variables of Kiln's environment the suite's tests may see, by name
    pick: Picker | None = None        # None: run every collected test

    def __post_init__(self) -> None:
        if self.isolate not in ISOLATIONS:
            raise InvalidInputError(f"isolate={self.isolate!r}: use {' or '.join(map(repr, ISOLATIONS))}")
        if self.start not in START_METHODS:
            raise InvalidInputError(f"start={self.start!r}: use {' or '.join(map(repr, START_METHODS))}")
        if not self.timeout_s > 0 or self.grace_s < 0:
            raise InvalidInputError(f"timeout={self.timeout_s!r} must be > 0 and grace={self.grace_s!r} >= 0")
        if not 0 <= self.retries <= 10:
            raise InvalidInputError(f"retries={self.retries!r} must be between 0 and 10")
        if self.parallel < 1:
            raise InvalidInputError(f"parallel={self.parallel!r} must be at least 1")


@dataclass(frozen=True)
class Item:
    index: int
    nodeid: str
    file: str
    gpus: int


@dataclass(frozen=True)
class Job:
    id: str
    items: tuple[Item, ...]

    @property
    def gpus(self) -> int:
        return max(item.gpus for item in self.items)
