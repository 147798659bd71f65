"""``kiln.toml`` → frozen, typed settings, validated once at the edge.

Nothing deeper in the pipeline reads raw TOML or environment variables: it
takes a :class:`KilnConfig`. Every problem becomes a :class:`ConfigError`
that names the key (with a did-you-mean for typos) before anything starts.
"""

from __future__ import annotations

import difflib
import hashlib
import threading
import tomllib
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidName, canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core.errors import ConfigError, InvalidInputError
from kiln.release.index import ProjectStatus, Status
from kiln.release.policies import STEPS, Step  # noqa: F401 (re-exported)
from kiln.release.upload_kinds import UPLOAD_KINDS
from kiln.tasks.project.archs import validate_arch
from kiln.tasks.project.config_build import ArchPolicy, Build, Testing, Toolchain, check_build_env, one_of  # noqa: F401 - Toolchain: part of the config's API
from kiln.tasks.project.config_fields import (
    BlockName,
    Endpoint,
    IndexUrl,
    PassEnv,
    ProjectPath,
    Region,
    StorePrefix,
    check_store_url,
)
from kiln.tasks.project.config_matrix import (
    Cell,
    Exclusion,
    check_exclusions,
    check_python_axis,
    check_torch_axis,
    expand,
)
from kiln.tasks.project.config_permissions import Credentials, Permission, unchosen_credentials  # noqa: F401 (re-exported)
from kiln.tasks.project.config_pools import Pools

# Closed sets, each spelled once: argparse choices and run-time checks derive from them (get_args).
Backend = Literal["cuda", "hip", "cpu"]
Channel = Literal["nightly", "release"]
BenchSize = Literal["small", "large"]
# A measured benchmark metric ([bench] blocking_metrics; a results file's decision metric).
Metric = Literal["graph_replay", "eager", "cpu"]
# A variant's torch ABI claim: "exact" pins the torch it was built against; "stable" promises the LibTorch
# stable ABI only (no at::/c10:: symbols), which the build's audit checks (kiln.tasks.build.abi_audit).
TorchAbi = Literal["exact", "stable"]
# The CPUs a variant's wheels are built for: the builder's own (x86_64), and aarch64 (NVIDIA Grace), cross-built
# on it (kiln.tasks.build.cross).
Platform = Literal["x86_64", "aarch64"]
PLATFORMS: tuple[Platform, ...] = get_args(Platform)
CHANNELS: tuple[Channel, ...] = get_args(Channel)
BENCH_SIZES: tuple[BenchSize, ...] = get_args(BenchSize)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _requirement(value: str) -> str:
    try:
        Requirement(value)
    except InvalidRequirement as exc:
        raise ValueError(f"{value!r} is not a valid requirement: {str(exc).splitlines()[0]}") from exc
    return value


def _dotted_name(value: str) -> bool:
    return all(part.isidentifier() for part in value.split("."))


class Project(_Model):
    package: str  # the import name of the package the wheel ships (e.g. kiln_kernels)
    distribution: str  # the project name its wheels and index pages carry (e.g. kiln-kernels)
    version: str  # the base version; a nightly appends .dev<commit time>, a release names its own
    source: ProjectPath  # the package's directory, relative to kiln.toml
    # The kernel registry ("module:attribute"): Kiln compiles its Triton kernels and CUDA sources.
    # Optional when [build] backend = "pep517" builds the wheel without one.
    registry: str | None = None
    requires_python: str = ">=3.10"  # the wheels' Requires-Python
    # The wheels' Requires-Dist, each a PEP 508 requirement checked at load.
    dependencies: tuple[Annotated[str, AfterValidator(_requirement)], ...] = ()
    # Publish the kiln-runtime wheel (kiln.runtime: spec types and the artifact loader) in every
    # index beside this project's wheels; default: when the wheels require kiln-runtime.
    runtime: bool | None = None
    # PEP 792 status marker on every project page Kiln writes (active, archived, quarantined, deprecated),
    # with an optional one-line reason (pypi:project-status-reason).
    status: Status = "active"
    status_reason: str = ""  # the one-line reason shown with a status other than active

    @property
    def page_status(self) -> ProjectStatus:
        return ProjectStatus(self.status, self.status_reason)

    @field_validator("status_reason")
    @classmethod
    def _one_line(cls, value: str) -> str:
        try:
            ProjectStatus("active", value)
        except InvalidInputError as exc:
            raise ValueError(str(exc).replace("project status reason", "the reason")) from exc
        return value

    @property
    def ships_runtime(self) -> bool:
        if self.runtime is not None:
            return self.runtime
        return any(canonicalize_name(Requirement(d).name) == "kiln-runtime" for d in self.dependencies)

    @field_validator("package")
    @classmethod
    def _import_name(cls, value: str) -> str:
        if not _dotted_name(value):
            raise ValueError(f"{value!r} is not an import name (dotted Python identifiers, e.g. 'my_kernels')")
        return value

    @field_validator("distribution")
    @classmethod
    def _pep508_name(cls, value: str) -> str:
        try:
            canonicalize_name(value, validate=True)
        except InvalidName as exc:
            raise ValueError(f"{value!r} is not a valid distribution name (PEP 508): letters, digits, '-', '_', '.',"
                             " starting and ending with a letter or digit") from exc
        return value

    @field_validator("requires_python")
    @classmethod
    def _specifier(cls, value: str) -> str:
        try:
            SpecifierSet(value)
        except InvalidSpecifier as exc:
            raise ValueError(f"{value!r} is not a valid version specifier (e.g. '>=3.10'): {exc}") from exc
        return value

    @field_validator("version")
    @classmethod
    def _pep440(cls, value: str) -> str:
        try:
            parsed = Version(value)
        except InvalidVersion as exc:
            raise ValueError(f"{value!r} is not a PEP 440 version") from exc
        if parsed.local:
            raise ValueError(f"{value!r} has a local part; the variant adds it (+cu130)")
        return value

    @field_validator("registry")
    @classmethod
    def _entry_point(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, _, attr = value.partition(":")
        if not module or not attr or not _dotted_name(module) or not _dotted_name(attr):
            raise ValueError(f"{value!r} must be 'module:attribute' (dotted Python names)")
        return value


def check_platforms(values: tuple[str, ...]) -> tuple[str, ...]:
    """A variant's ``platform`` list: known CPUs, each once, at least one."""
    if not values:
        raise ValueError(f"platform is empty: name at least one of {list(PLATFORMS)}")
    for value in values:
        one_of(value, PLATFORMS, "a platform Kiln builds for")
    if len(set(values)) != len(values):
        raise ValueError(f"duplicate platforms in {list(values)}")
    return values


class Variant(_Model):
    # The variant's name: its local version label (+cu130), index folder and unit ids.
    name: str = Field(pattern=r"^[a-z][a-z0-9]*$")
    backend: Backend  # what its kernels are compiled for: CUDA, ROCm (hip) or none (cpu)
    archs: tuple[str, ...] = ()  # the GPU archs compiled for, e.g. ["8.0", "9.0+PTX"] or ["gfx942"]; empty for cpu
    # Requires-Dist of this variant's wheel beyond [project].dependencies (e.g. a CUDA runtime).
    dependencies: tuple[Annotated[str, AfterValidator(_requirement)], ...] = ()
    # The variant's own build environment (e.g. a CUDA build of torch), made once and cached; empty: Kiln's own.
    build_requires: tuple[Annotated[str, AfterValidator(_requirement)], ...] = ()
    # Variables exported to the variant's build (a package's own switches); part of the cache key.
    build_env: Annotated[dict[str, str], AfterValidator(check_build_env)] = Field(default_factory=dict)
    arch_policy: ArchPolicy = "exact"  # what a kernel's supported archs do to the list: see the build-matrix guide
    # "stable": one wheel over torch's stable ABI for every torch of the axis (torch>= in its metadata).
    abi: TorchAbi = "exact"
    # abi = "stable" only: the oldest torch (major.minor) its one wheel claims, passed to its build as
    # TORCH_TARGET_VERSION (kiln.tasks.build.stable_abi); default: the torch it builds against.
    torch_target: str | None = Field(default=None, pattern=r"^[0-9]+\.[0-9]+$")
    # Matrix axes (kiln.tasks.project.config_matrix): the Pythons and torches this variant is built for, less
    # the cells `exclude` names. Expanded at load into one variant per cell; none: one wheel, as before.
    python: Annotated[tuple[str, ...], AfterValidator(check_python_axis)] = ()
    # The torch axis: one cell per requirement, e.g. ["==2.13.0", "==2.14.1"].
    torch: Annotated[tuple[str, ...], AfterValidator(check_torch_axis)] = ()
    exclude: tuple[Exclusion, ...] = ()  # cells of this variant's axes that are not built, each a table of axis values
    # The CPUs its wheels are built for; aarch64 wheels are cross-built on this x86_64 builder
    platform: Annotated[tuple[str, ...], AfterValidator(check_platforms)] = ("x86_64",)
    # Set by Kiln on each expanded cell (never in kiln.toml): the cell it stands for.
    cell: Cell | None = None

    @property
    def label(self) -> str:
        """The wheel's local label: the variant's name, or its cell's (``cu130torch2.14``)."""
        return self.cell.label if self.cell is not None else self.name

    @model_validator(mode="after")
    def _axes(self) -> Variant:
        try:
            check_exclusions(self.python, self.torch, self.exclude)
        except ValueError as exc:
            raise ValueError(f"variant {self.name!r}: {exc}") from exc
        return self

    @model_validator(mode="after")
    def _target(self) -> Variant:
        if self.torch_target is not None and self.abi != "stable":
            raise ValueError(f"variant {self.name!r}: torch_target = {self.torch_target!r} needs abi = \"stable\""
                             " (an exact variant's wheel pins the torch it was built against)")
        return self

    @model_validator(mode="after")
    def _archs(self) -> Variant:
        if self.backend == "cpu" and self.archs:
            raise ValueError(f"variant {self.name!r}: backend 'cpu' takes no archs")
        try:
            canonical = tuple(validate_arch(a, self.backend) for a in self.archs)
        except InvalidInputError as exc:
            raise ValueError(f"variant {self.name!r}: {exc}") from exc
        if len(set(canonical)) != len(canonical):
            raise ValueError(f"variant {self.name!r}: duplicate archs in {list(self.archs)}")
        object.__setattr__(self, "archs", canonical)
        return self


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
    # (the units one machine runs at once) and 1 while the suite has no recorded durations.
    shards: Annotated[int, Field(ge=1, le=64, strict=True)] | Literal["auto"] = 1
    # The recorded duration, in seconds, each shard of an "auto" suite is kept under.
    shard_target_s: float = Field(default=600, gt=0)

    @model_validator(mode="before")
    @classmethod
    # Any: the raw TOML table, before the model validates it
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, SUITE_RENAMES, "[[suites]]")


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


class Target(_Model):
    url: Annotated[str, AfterValidator(check_store_url)]  # where the indexes go: file://path, or s3://bucket/prefix
    region: Region | None = None  # the S3 bucket's region (default: the AWS configuration's)
    endpoint: Endpoint | None = None  # an S3-compatible endpoint URL instead of AWS's
    # The 12-digit AWS account that must own the bucket (S3's expected-bucket-owner check).
    expected_owner: str | None = Field(default=None, pattern=r"^[0-9]{12}$")
    # Whether the S3 server checks the ChecksumSHA256 it is sent (then a write needs no
    # read-back). Unset: true on AWS, false with a custom endpoint (moto does not check).
    verifies_checksums: bool | None = None
    # A file:// store is owner-only (its root 0700), and a root another user owns or may write into is
    # refused; public = true keeps it readable by every local user and accepts such a root, for an index
    # another user's web server serves.
    public: bool = False
    # The CDN or web server in front of this store (its root), where users download: after a publish, every new
    # file and changed page is downloaded through it and must have the index's sha256 (kiln.release.public).
    public_url: IndexUrl | None = None

    @property
    def kind(self) -> Literal["file", "s3"]:
        return "s3" if self.url.startswith("s3://") else "file"

    @model_validator(mode="after")
    def _s3_only(self) -> Target:
        if self.verifies_checksums is not None and self.kind != "s3":
            raise ValueError(f"verifies_checksums applies to s3:// targets only, not {self.url!r}")
        if self.public and self.kind != "file":
            raise ValueError(f"public applies to file:// targets only (a bucket policy decides), not {self.url!r}")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError(f"public_url {self.public_url!r} must be the http(s):// URL users download from (a CDN"
                             " or web server in front of the store)")
        return self


class UploadTarget(_Model):
    """``[publish.targets.<name>]`` with ``kind = "upload"``: a PyPI-compatible index (kiln.release.upload).

    Only the release flow uploads there, after Kiln's own indexes: the ``pypi_variant``'s wheel under the
    release's public version, judged first by PyPI's rules (kiln.release.pypi_plan)."""

    kind: str  # an upload kind of kiln.release.upload_kinds ("upload": a PyPI-compatible upload API), checked at load
    url: IndexUrl  # the legacy upload API, e.g. https://upload.pypi.org/legacy/
    index_url: IndexUrl  # its simple API, read for what the project already holds, e.g. https://pypi.org/simple/
    pypi_variant: str  # the one variant that goes there (PyPI refuses local versions such as +cu130)
    size_limit_mib: int = Field(default=100, ge=1, le=1024)  # PyPI's default; a grant is at most 1 GiB
    quota_gib: float = Field(default=10, gt=0)  # the project's total on the index
    token_block: BlockName | None = None  # the Prefect Secret block holding the API token
    # Instead of a token: the worker's OIDC identity (GitHub Actions, GitLab, Google Cloud) exchanged at the
    # index for a short-lived upload token inside the upload task (kiln.release.trusted_publishing).
    trusted_publishing: bool = False
    oidc_url: IndexUrl | None = None  # where /_/oidc/audience and /_/oidc/mint-token are; default: url's host
    username: str = "__token__"  # the upload's user name; PyPI's API tokens go with __token__
    timeout_s: float = Field(default=1800, gt=0, le=7200)  # one file's upload
    # The project's sdist too, built at the release's public version and sent after the wheel (a pep517 project
    # only: a registry package's sources build nothing without Kiln's AOT step; see kiln.tasks.build.sdist).
    sdist: bool = False

    @model_validator(mode="after")
    def _one_credential(self) -> UploadTarget:
        if self.trusted_publishing and self.token_block is not None:
            raise ValueError("token_block and trusted_publishing = true both set: choose one (an API token from"
                             " a Secret block, or the worker's OIDC identity exchanged at the index)")
        return self


# Any: the raw TOML table, before the model validates it
def _split_upload_targets(data: Any) -> Any:
    """``kind = "upload"`` tables of [publish.targets] become ``upload_targets``: every other reader of
    ``targets`` (stores, policies, credentials) keeps seeing file:// and s3:// targets only."""
    if not isinstance(data, dict) or not isinstance(data.get("targets"), dict):
        return data
    targets = data["targets"]
    uploads = {k: v for k, v in targets.items() if isinstance(v, dict) and "kind" in v}
    for name, table in uploads.items():
        _check_upload_kind(name, table["kind"])
    return {**data, "targets": {k: v for k, v in targets.items() if k not in uploads},
            "upload_targets": {**data.get("upload_targets", {}), **uploads}}


def _check_upload_kind(name: str, kind: object) -> None:
    """``kind`` is a key of the kinds table, read as names only: no uploader (nor twine, nor wheel) is imported,
    since every process that loads kiln.toml comes here, some inside a wheel's environment without them."""
    if isinstance(kind, str) and kind in UPLOAD_KINDS:
        return
    hint = difflib.get_close_matches(str(kind), list(UPLOAD_KINDS), n=1)
    raise ValueError(f"targets.{name}.kind: {kind!r} is not a target kind"
                     + (f" (did you mean {hint[0]!r}?)" if hint else "")
                     + f"; the kinds are {sorted(UPLOAD_KINDS)} (\"upload\": a PyPI-compatible index);"
                     " file:// and s3:// targets are told by their url")


class PublishRetention(_Model):
    """``[publish.retention]``: what ``kiln prune`` keeps of a nightly channel (kiln.release.prune)."""

    keep: int = Field(default=60, ge=1)  # newest versions kept per project and variant index
    grace_days: float = Field(default=7, ge=0)  # yanked this long before removal


class Publish(_Model):
    default_target: str = "local"  # the target a nightly publishes to when none is named
    # Each channel's folder name in a target (nightly, release).
    channels: dict[Channel, StorePrefix] = {"nightly": "nightly", "release": "release"}
    targets: dict[str, Target] = {}  # the publish targets by name: file:// or s3:// stores, or kind = "upload" indexes
    # Where the project's dependencies come from when installing from a Kiln index (which holds only the
    # project's own wheels): named in the install hint of every run and used by `kiln verify` on request.
    extra_index_urls: tuple[IndexUrl, ...] = ("https://pypi.org/simple",)
    # Pinned third-party wheels re-published in every index (see kiln.release.pins), relative to kiln.toml.
    pins: ProjectPath | None = None
    # A variant no suite ran on is published marked "PUBLISHED UNTESTED"; false holds it back instead,
    # and also every variant whose suite could not run here, whatever that suite's publish_untested says.
    publish_untested: bool = True
    # Before anything is uploaded, each variant's wheel must resolve with its dependencies (pip's resolver) from
    # the index as staged plus extra_index_urls. "refuse": a variant that does not is held back, naming the
    # requirement or the conflict; "warn": it is published, and the summary's first lines say it will not
    # install; "off": no check.
    check_dependencies: Literal["refuse", "warn", "off"] = "refuse"
    retention: PublishRetention = PublishRetention()  # what kiln prune keeps of a nightly channel
    # [publish.targets.<name>] tables with kind = "upload" (PyPI-compatible indexes), split out at load.
    upload_targets: dict[str, UploadTarget] = {}

    @model_validator(mode="before")
    @classmethod
    # Any: the raw TOML table, before the model validates it
    def _uploads(cls, data: Any) -> Any:
        return _split_upload_targets(data)

    @model_validator(mode="after")
    def _default_exists(self) -> Publish:
        if self.default_target not in self.targets:
            raise ValueError(f"default_target {self.default_target!r} is not one of {sorted(self.targets)}")
        return self


class KilnConfig(_Model):
    project: Project
    variants: tuple[Variant, ...]
    build: Build = Build()
    suites: tuple[Suite, ...] = ()
    testing: Testing = Testing()
    pools: Pools = Pools()
    bench: Bench = Bench()
    artifacts: Target = Target(url="file://.kiln/artifacts")
    publish: Publish
    permissions: dict[Step, Permission] = {}
    root: Path = Field(default=Path("."), exclude=True)
    # The file this config was read from (absolute; root is its directory): a run records it, and code
    # below a flow's entry takes the config object, never the path again.
    config_file: Path = Field(default=Path("kiln.toml"), exclude=True)

    @model_validator(mode="before")
    @classmethod
    # Any: the raw TOML table, before the model validates it
    def _no_cell_key(cls, data: Any) -> Any:
        variants = data.get("variants") if isinstance(data, dict) else None
        for index, variant in enumerate(variants if isinstance(variants, (list, tuple)) else ()):
            if isinstance(variant, dict) and "cell" in variant:
                raise ValueError(f"variants[{index}].cell: Kiln sets it on each cell of a matrix; list the axes"
                                 " instead (python = [...], torch = [...], exclude = [...])")
        return data

    @model_validator(mode="after")
    def _cells(self) -> KilnConfig:
        """Each variant with matrix axes becomes its cells (kiln.tasks.project.config_matrix), in place."""
        if any(v.python or v.torch for v in self.variants):
            object.__setattr__(self, "variants", tuple(cell for v in self.variants for cell in expand(v)))
        return self

    def cells_of(self, name: str) -> tuple[Variant, ...]:
        """The variants ``name`` stands for: a variant, or every cell of a matrix variant ("" if none)."""
        return tuple(v for v in self.variants if v.name == name or (v.cell is not None and v.cell.matrix == name))

    @model_validator(mode="after")
    def _unique_names(self) -> KilnConfig:
        for kind, names in (("variant", [v.name for v in self.variants]), ("suite", [s.name for s in self.suites])):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"duplicate {kind} names: {dupes}")
        known = {v.name for v in self.variants} | {v.cell.matrix for v in self.variants if v.cell is not None}
        for index, suite in enumerate(self.suites):
            unknown = [name for name in suite.variants if name not in known]
            if unknown:
                raise ValueError(f"suites[{index}].variants: unknown variants {unknown} (suite {suite.name!r}); "
                                 f"kiln.toml defines {sorted(known)}")
        if self.project.registry is None and self.build.backend != "pep517":
            raise ValueError("project.registry is missing: Kiln's own wheel builder compiles the kernels a registry"
                             " names; give one, or set [build] backend = \"pep517\" to build with the project's"
                             " pyproject.toml")
        return self

    @model_validator(mode="after")
    def _upload_variants(self) -> KilnConfig:
        known = sorted(v.name for v in self.variants)
        for name, target in sorted(self.publish.upload_targets.items()):
            if target.pypi_variant not in known:
                hint = difflib.get_close_matches(target.pypi_variant, known, n=1)
                raise ValueError(f"publish.targets.{name}.pypi_variant: unknown variant {target.pypi_variant!r}"
                                 + (f" (did you mean {hint[0]!r}?)" if hint else "") + f"; kiln.toml defines {known}")
            if target.sdist and self.build.backend != "pep517":
                raise ValueError(f"publish.targets.{name}.sdist: only a project built by its own backend ([build]"
                                 " backend = \"pep517\") has an sdist; Kiln's wheel builder compiles the kernels"
                                 " ahead of time into wheels, and its sources alone build nothing to install")
        return self

    @model_validator(mode="after")
    def _triton_jit(self) -> KilnConfig:
        """A pure-Triton package: its own backend builds one portable wheel, in one variant of no hardware."""
        if self.build.kind != "triton-jit":
            return self
        if self.build.backend != "pep517":
            raise ValueError("build.kind = \"triton-jit\": the project's own backend builds the portable wheel;"
                             " set [build] backend = \"pep517\"")
        shape = [(v.name, v.backend, list(v.archs)) for v in self.variants]
        if len(self.variants) != 1 or self.variants[0].backend != "cpu":
            raise ValueError("build.kind = \"triton-jit\" builds one portable wheel that every suite tests: give"
                             " exactly one [[variants]] with backend = \"cpu\" and no archs (e.g. name = \"any\"),"
                             f" not {shape}")
        return self

    @model_validator(mode="after")
    def _explicit_credentials(self) -> KilnConfig:
        urls = [target.url for _, target in sorted(self.publish.targets.items())]
        unchosen = unchosen_credentials(self.permissions, self.artifacts.url, urls)
        if unchosen:
            raise ValueError("\n  - ".join(unchosen))
        return self

    def suite_variants(self, suite: Suite) -> tuple[Variant, ...]:
        """The variants ``suite`` tests: its own list, else by the hardware it needs."""
        if suite.variants:
            return tuple(cell for name in suite.variants for cell in self.cells_of(name))
        wanted = [v for v in self.variants if (v.backend == "cpu") == (suite.gpus == 0)]
        return tuple(wanted or self.variants[:1])

    def suite_pool(self, suite: Suite) -> str | None:
        """The work pool ``suite`` is dispatched to: its own, else the CPU pool for a CPU suite."""
        return suite.pool or (self.pools.cpu if suite.gpus == 0 else None)

    @property
    def suites_by_name(self) -> dict[str, Suite]:
        return {suite.name: suite for suite in self.suites}

    def variant(self, name: str) -> Variant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        cells = [v.name for v in self.cells_of(name)]
        if cells:
            raise ConfigError(f"variant {name!r} is a matrix: name one of its cells {cells}")
        raise ConfigError(f"unknown variant {name!r}; kiln.toml defines {[v.name for v in self.variants]}")

    def path(self, relative: str) -> Path:
        """A path from kiln.toml, resolved against the file's directory."""
        return (self.root / relative).resolve()

    @property
    def import_root(self) -> Path:
        """The directory the package is imported from: the parent of ``project.source``
        (the project root for a flat layout, ``src/`` for a src layout)."""
        return self.path(self.project.source).parent


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Known keys at ``loc`` (for the did-you-mean of an unknown key)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        info = getattr(current, "model_fields", {}).get(part)
        if info is None:
            return []
        annotation = info.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        current = candidates[0] if candidates else None
    return list(getattr(current, "model_fields", {}) or [])


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        key = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")
        key = key.replace("publish.upload_targets.", "publish.targets.")  # as the file spells it (kind = "upload")
        if error["type"] == "extra_forbidden":
            known = [k for k in _field_names(KilnConfig, loc) if k != "root"]
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            listing = f"; known keys: {', '.join(known)}" if known else ""
            suggestion = f"; did you mean {hint[0]!r}?" if hint else listing
            lines.append(f"unknown key {key!r}{suggestion}")
        elif error["type"] == "missing":
            lines.append(f"missing key {key!r}")
        else:
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {message}" if key else message)  # a whole-file rule names its own keys
    return ConfigError(f"{source} is invalid:\n  - " + "\n  - ".join(lines))


def _check_paths(config: KilnConfig, source: str) -> None:
    missing = []
    if not config.path(config.project.source).is_dir():
        missing.append(f"project.source = {config.project.source!r}")
    project_dir = config.path(config.build.project_dir)
    builds = ("pyproject.toml", "setup.py")
    if config.build.backend == "pep517" and not any((project_dir / n).is_file() for n in builds):
        # a setup.py alone builds too: through setuptools' legacy backend, PEP 517's fallback (as pip does)
        missing.append(f"build.project_dir = {config.build.project_dir!r} has no pyproject.toml or setup.py"
                       " (backend = 'pep517')")
    if config.publish.pins and not config.path(config.publish.pins).is_file():
        missing.append(f"publish.pins = {config.publish.pins!r}")
    toolchain = config.build.toolchain
    for key, paths in (("include_dirs", toolchain.include_dirs), ("library_dirs", toolchain.library_dirs)):
        missing += [f"build.toolchain.{key}: {p!r}" for p in paths if not config.path(p).is_dir()]
    for index, suite in enumerate(config.suites):
        for path in suite.paths:
            if not config.path(path).exists():
                missing.append(f"suites[{index}].paths: {path!r} (suite {suite.name!r})")
    if missing:
        raise ConfigError(f"{source} names paths that do not exist (relative to {config.root}):\n  - "
                          + "\n  - ".join(missing))


def parse_config(data: dict[str, Any], root: Path, source: str = "kiln.toml",
                 config_file: Path | None = None) -> KilnConfig:
    """``data`` as a :class:`KilnConfig` rooted at ``root``; ``config_file`` is where it was read from."""
    for internal in ("root", "config_file"):
        if internal in data:
            raise ConfigError(f"{source}: {internal!r} is not a key of kiln.toml (Kiln sets it from the file's place)")
    file = root.resolve() / (config_file.name if config_file else "kiln.toml")  # not resolved: a link stays in root
    try:
        config = KilnConfig.model_validate({**data, "root": root.resolve(), "config_file": file})
    except ValidationError as exc:
        raise _explain(exc, source) from None
    _check_paths(config, source)
    return config


# One config object per file content per process: repeated loads (every flow
# and task loads kiln.toml) return the same frozen object without re-parsing.
_CACHE_SIZE = 32
_cache: OrderedDict[tuple[str, bytes], KilnConfig] = OrderedDict()
_cache_lock = threading.Lock()


def load_config(path: str | Path = "kiln.toml") -> KilnConfig:
    """Read and validate ``kiln.toml``; raise :class:`ConfigError` on any problem.

    Within a process the same file content at the same path gives the same
    object (an edited file is read afresh); a config that failed is not kept.
    The paths it names are checked when the content is first loaded.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (pass --config FILE)") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    key = (str(path.resolve()), hashlib.sha256(raw).digest())
    with _cache_lock:  # held while parsing, so concurrent first loads agree on one object
        config = _cache.get(key)
        if config is None:
            config = _parse_bytes(raw, path)
            _cache[key] = config
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        _cache.move_to_end(key)
    return config


def _parse_bytes(raw: bytes, path: Path) -> KilnConfig:
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_config(data, path.parent, str(path), config_file=path)
