"""``[[suites]]`` and ``[bench]`` of kiln.toml: what runs against each variant's installed wheel, and how a
benchmark result is judged against the history.

Part of :class:`kiln.tasks.project.config.KilnConfig`, validated with it at load.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.tasks.project.config_fields import PassEnv, ProjectPath, StorePrefix

BenchSize = Literal["small", "large"]
# A measured benchmark metric ([bench] blocking_metrics; a results file's decision metric).
Metric = Literal["graph_replay", "eager", "cpu"]
BENCH_SIZES: tuple[BenchSize, ...] = get_args(BenchSize)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Keys renamed in an earlier release: the old spelling still loads, for one release, with a warning.
SUITE_RENAMES = {"timeout_s": "test_timeout_s"}


# Any: the raw TOML table, before the model validates it
def renamed_keys(data: Any, renames: Mapping[str, str], table: str) -> Any:
    """``data`` with each deprecated key of ``renames`` under its new name, warning once per key; both
    spellings at once is an error (which one is meant is not Kiln's guess)."""
    if not isinstance(data, Mapping) or not any(old in data for old in renames):
        return data
    out = dict(data)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{table}: both {old!r} (deprecated) and {new!r} are set; keep only {new!r}")
        warnings.warn(f"kiln.toml {table}: {old!r} is deprecated and will be removed in a later release;"
                      f" rename it to {new!r}", FutureWarning, stacklevel=2)
        out[new] = out.pop(old)
    return out


class Suite(_Model):
    # The suite's name: its unit ids (test/<name>/<variant>) and reports.
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    paths: tuple[ProjectPath, ...]  # the test files and folders, relative to kiln.toml
    markers: str = ""  # a pytest -m expression selecting the suite's tests
    gpus: int = Field(default=0, ge=0)  # GPUs each test needs; a machine with fewer reports the suite not run
    # The paths whose change selects the suite under --changed-since (its own paths always do).
    depends: tuple[ProjectPath, ...] = ()
    required: bool = True  # whether a failure of this suite fails the run and holds its variant back from publishing
    test_timeout_s: float = Field(default=300, gt=0)  # each test's deadline; deadline_s is the whole suite's
    # The work pool of its hardware: the nightly dispatches this suite to the pool's "test/<pool>"
    # deployment when the server has it, else runs it here (default: [pools] cpu for a CPU suite).
    pool: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    deadline_s: float = Field(default=3600, gt=0)  # the whole suite, when dispatched
    # The variants whose installed wheel the suite tests (default: the CPU variants for a
    # suite of no GPUs, the GPU variants otherwise) and what else its tests import.
    variants: tuple[str, ...] = ()
    # What the tests import beyond the wheel and its dependencies, installed into their environment.
    requires: tuple[str, ...] = ()
    # A required suite that could not run here (no GPU of its kind) holds its variant
    # back unless this says the variant may be published untested on its hardware.
    publish_untested: bool = False
    # Variables of the step's environment its tests may see, each by name (they run as guests: an allow-list,
    # never a credential, identity or Prefect variable).
    pass_env: PassEnv = ()
    # How many units the suite's tests are split into, each run like a suite of its own (kiln.tasks.testing.shards):
    # balanced by the durations the test history holds, longest first, tests without history spread evenly.
    # "auto": enough shards to keep each under shard_target_s of recorded duration, at most [build] jobs
    # (the units one machine runs at once; a suite dispatched to a pool: the pool's live workers) and 1 while
    # the suite has no recorded durations.
    shards: Annotated[int, Field(ge=1, le=64, strict=True)] | Literal["auto"] = 1
    # The recorded duration, in seconds, each shard of an "auto" suite is kept under.
    shard_target_s: float = Field(default=600, gt=0)
    # An aarch64 cell's suite on an x86_64 machine runs under emulation (qemu-user, an arm64 Debian userland; root):
    # slow, so each suite opts in. Without it, or where the machine cannot emulate, it is "not run".
    emulate: bool = False

    @model_validator(mode="before")
    @classmethod
    # Any: the raw TOML table, before the model validates it
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, SUITE_RENAMES, "[[suites]]")

    @model_validator(mode="after")
    def _emulated_whole(self) -> Suite:
        if self.emulate and self.shards != 1:
            raise ValueError(f"suite {self.name!r}: emulate = true runs the suite whole under emulation; give it"
                             f" shards = 1 (it has shards = {self.shards!r})")
        return self


class RegressionPolicy(_Model):
    """How a run's case is judged against the stored history (``kiln history``): its baseline is the
    median of the last ``window`` comparable runs (same variant, metric and hardware), its noise band
    ``noise_k`` times their spread (scaled MAD) but never under ``[bench] threshold``."""

    # How many earlier runs the median a result is compared with is taken over.
    window: int = Field(default=5, ge=2, le=100)
    min_runs: int = Field(default=3, ge=1)  # fewer comparable runs: "insufficient data"
    # How many median absolute deviations of the window count as noise, not a change.
    noise_k: float = Field(default=3.0, gt=0, le=20)

    @model_validator(mode="after")
    def _fits(self) -> RegressionPolicy:
        if self.min_runs > self.window:
            raise ValueError(f"min_runs ({self.min_runs}) cannot exceed window ({self.window})")
        return self


class Bench(_Model):
    size: BenchSize = "small"  # the bench cases' size the harness asks each kernel for
    # A slowdown above this fraction of the baseline is a regression.
    threshold: float = Field(default=0.05, gt=0, lt=10)
    history: StorePrefix = "bench-history"  # the artifact-store prefix results are kept under, for comparisons
    regression: RegressionPolicy = RegressionPolicy()  # how a result is judged against the window of earlier runs
    # Decision metrics whose regressions stop a release. CUDA-graph replay on a dedicated GPU is
    # steady enough to block; CPU timings on a shared machine are advisory unless listed here.
    blocking_metrics: tuple[Metric, ...] = ("graph_replay",)
    # false: the bench stage of every run is "not run" (a package with no benchmarks Kiln can run).
    enabled: bool = True
