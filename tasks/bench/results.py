"""The benchmark results file: schema, validation on load, and run metadata.

One file per benchmark run. Every case carries its raw samples and the
reference's samples measured in the same run, so a later comparison can
re-derive every statistic, and the kernel/reference ratio stays meaningful
when the machine itself drifts between runs.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core.errors import InvalidInputError
from kiln.core.fsutil import atomic_write_text
from kiln.tasks.project.config import Metric

SCHEMA_VERSION: Literal[1] = 1
# What ``--metric`` accepts: a measured metric, or auto (graph replay on a GPU, else cpu).
MetricChoice = Literal["auto", "graph_replay", "eager", "cpu"]
_log = logging.getLogger(__name__)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # ``created``: the producing run's start, UTC, to the second


def iso_time(when: float) -> str:
    """``when`` (Unix seconds) as ``created`` spells it."""
    return datetime.fromtimestamp(when, UTC).strftime(TIME_FORMAT)


def parse_time(text: str) -> float:
    """``created`` as Unix seconds; a ValueError names what is wrong."""
    try:
        return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise ValueError(f"{text!r} is not a UTC time of the form 2026-11-29T19:02:27Z") from None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Stats(_Model):
    """Per-call times in seconds and what was derived from them."""

    samples: tuple[float, ...] = Field(min_length=1)
    median: float = Field(gt=0)
    spread: float = Field(ge=0)  # interquartile range, seconds
    ci_low: float = Field(gt=0)
    ci_high: float = Field(gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> Stats:
        if any(s <= 0 for s in self.samples):
            raise ValueError("samples must be positive times in seconds")
        if not self.ci_low <= self.median <= self.ci_high:
            raise ValueError(f"median {self.median} lies outside its interval [{self.ci_low}, {self.ci_high}]")
        return self


class CaseResult(_Model):
    kernel: str = Field(min_length=1)
    name: str = Field(min_length=1)
    shape: dict[str, int]
    dtype: str
    metric: Metric
    stats: Stats
    reference: Stats | None = None
    bytes: int = Field(default=0, ge=0)
    flops: int = Field(default=0, ge=0)
    # Derived from the fields above on every load, so they can never disagree with the samples.
    speedup: float | None = None  # reference time / kernel time: above 1, the kernel is faster
    gbps: float | None = None  # achieved bandwidth, when the kernel declares its bytes
    tflops: float | None = None  # achieved FLOP rate, when the kernel declares its FLOPs

    @model_validator(mode="after")
    def _derive(self) -> CaseResult:
        median = self.stats.median
        object.__setattr__(self, "speedup", self.reference.median / median if self.reference else None)
        object.__setattr__(self, "gbps", self.bytes / median / 1e9 if self.bytes else None)
        object.__setattr__(self, "tflops", self.flops / median / 1e12 if self.flops else None)
        return self

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kernel, self.name, self.metric)


class Hardware(_Model):
    device: str
    driver: str
    cpu: str


class BenchResults(_Model):
    schema_version: Literal[1] = SCHEMA_VERSION
    commit: str
    variant: str
    flow: str  # "nightly", "release", "bench": `last` only trusts nightlies
    run_id: str
    created: str  # the producing run's start (its run record's, written by Kiln's step process): TIME_FORMAT
    size: str
    decision_metric: Metric
    hardware: Hardware
    versions: dict[str, str]
    cases: tuple[CaseResult, ...]

    @field_validator("created")
    @classmethod
    def _a_time(cls, value: str) -> str:
        parse_time(value)
        return value

    @model_validator(mode="after")
    def _unique(self) -> BenchResults:
        keys = [c.key for c in self.cases]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"duplicate cases (kernel, name, metric): {dupes}")
        return self

    def case(self, key: tuple[str, str, str]) -> CaseResult | None:
        return next((c for c in self.cases if c.key == key), None)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


def parse_results(text: str | bytes, source: str) -> BenchResults:
    """Validate a results document; every problem names ``source`` and the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"benchmark results {source} are not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"benchmark results {source}: expected a JSON object, got {type(data).__name__}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise InvalidInputError(
            f"benchmark results {source} have schema_version {data.get('schema_version')!r};"
            f" this Kiln reads {SCHEMA_VERSION}"
        )
    try:
        return BenchResults.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]]
        raise InvalidInputError(f"benchmark results {source} are invalid:\n  - " + "\n  - ".join(problems)) from None


def load_results(path: str | Path) -> BenchResults:
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise InvalidInputError(f"benchmark results file {path} does not exist") from None
    except OSError as exc:
        raise InvalidInputError(f"benchmark results file {path} cannot be read: {exc}") from exc
    return parse_results(text, str(path))


def save_results(results: BenchResults, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, results.to_json())
    return path


# --- run metadata --------------------------------------------------------------

Runner = Callable[..., subprocess.CompletedProcess[str]]


def _query(argv: list[str], cwd: Path | None, run: Runner, timeout: float) -> str | None:
    _log.info("running %s", " ".join(argv))
    try:
        done = run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _log.warning("%s failed: %s", argv[0], exc)
        return None
    out = done.stdout.strip()
    return out if done.returncode == 0 and out else None


def git_commit(root: Path, *, run: Runner = subprocess.run, timeout: float = 10) -> str:
    """The checked-out commit of ``root``, or "unknown" outside a git checkout."""
    return _query(["git", "rev-parse", "HEAD"], root, run, timeout) or "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def hardware(device: str, *, run: Runner = subprocess.run, timeout: float = 10) -> Hardware:
    """Device name, driver version and CPU model of the machine that measured."""
    if device == "cpu":
        return Hardware(device="cpu", driver="none", cpu=cpu_model())
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = None if torch.version.hip else _query(query, None, run, timeout)
    return Hardware(device=name, driver=(driver or "unknown").splitlines()[0], cpu=cpu_model())


def library_versions(distribution: str) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("torch", "triton", "numpy", distribution):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    import torch

    versions["cuda"] = torch.version.cuda or "none"
    versions["hip"] = torch.version.hip or "none"
    return versions
