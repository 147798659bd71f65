"""The ``[build]`` and ``[testing]`` sections of ``kiln.toml``: who builds the wheel, with which toolchain settings.

Kept apart from :mod:`kiln.tasks.project.config` so each module has one subject;
the models are part of :class:`kiln.tasks.project.config.KilnConfig` and validated
with it, once, at the edge.
"""

from __future__ import annotations

import difflib
import logging
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.tasks.project.config_axes import check_python_axis
from kiln.tasks.project.config_fields import LocalPath, PassEnv, ProjectPath, StorePrefix

_log = logging.getLogger(__name__)

# kiln: Kiln writes the wheel from the package's files and its compiled artifacts.
# pep517: the project's own build backend (pyproject.toml) builds each variant's wheel;
# Kiln exports the variant's archs, checks the device code in the wheel and adds its AOT artifacts.
BuildBackend = Literal["kiln", "pep517"]
BUILD_BACKENDS: tuple[str, ...] = get_args(BuildBackend)
# native: one wheel per variant, each holding its hardware's device code (built by Kiln or by the project).
# triton-jit: a pure-Triton package whose kernels compile at run time: one portable py3-none-any wheel built by
# the project's own backend (pep517), with no local label, in one variant that every suite tests (CPU suites
# through the Triton interpreter, GPU suites on their pools); no device code expected, none refused.
PackageKind = Literal["native", "triton-jit"]
PACKAGE_KINDS: tuple[str, ...] = get_args(PackageKind)
# What a variant's wheel must hold of the archs it asked for: exactly them (exact), every one of them and
# perhaps more (at_least: a package that picks its own -gencode list), or whatever it holds (record); narrow:
# a pep517 CUDA build that picks its own -gencode list compiles through Kiln's nvcc, which drops every target
# outside the variant's archs (tasks/build/nvcc_narrow.py), and its wheel must then hold exactly them.
ArchPolicy = Literal["exact", "at_least", "record", "narrow"]
ARCH_POLICIES: tuple[str, ...] = get_args(ArchPolicy)
# The arch list is the variant's: build_env may not set these (the build exports them from `archs`).
ARCH_VARIABLES = ("TORCH_CUDA_ARCH_LIST", "CMAKE_CUDA_ARCHITECTURES", "CUDAARCHS", "PYTORCH_ROCM_ARCH", "HIPARCHS")

# Flags that choose device code: the arch list is the plan's alone (never 'native', never a second list).
_ARCH_FLAGS = ("-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code", "--gpu-code",
               "--offload-arch", "--amdgpu-target", "-march")


def one_of(value: object, choices: tuple[str, ...], what: str) -> object:
    """``value`` when it is not a string or is one of ``choices``; else a did-you-mean error naming ``what``."""
    if isinstance(value, str) and value not in choices:
        hint = difflib.get_close_matches(value, choices, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"{value!r} is not {what} (one of {', '.join(choices)}){suggestion}")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _flag(value: str) -> str:
    if not value or any(ord(ch) < 32 for ch in value):
        raise ValueError(f"{value!r} is not a compiler flag (empty, or contains a control character)")
    if value.split("=")[0] in _ARCH_FLAGS or "native" in value.split("="):
        raise ValueError(f"{value!r} chooses device archs; the variant's arch list does that (kiln.toml [[variants]])")
    return value


def _define(value: str) -> str:
    name = value.partition("=")[0]
    if not name.isidentifier() or any(ord(ch) < 32 for ch in value):
        raise ValueError(f"{value!r} is not a macro definition ('NAME' or 'NAME=VALUE')")
    return value


def _library(value: str) -> str:
    if not value or not all(ch.isalnum() or ch in "_.+-" for ch in value) or value.startswith("-"):
        raise ValueError(f"{value!r} is not a library name as -l takes it (e.g. 'cudart', 'c10')")
    return value


def _pattern(value: str) -> str:
    if not value or value.startswith("/") or ".." in value.split("/"):
        raise ValueError(f"{value!r} must be a glob relative to the package directory (no leading '/', no '..')")
    return value


Flag = Annotated[str, AfterValidator(_flag)]


def check_build_env(env: dict[str, str]) -> dict[str, str]:
    """A variant's ``build_env``: shell-style names, printable values, no arch variable."""
    for name, value in env.items():
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
            raise ValueError(f"build_env name {name!r} is not an environment variable name (letters, digits, _)")
        if name in ARCH_VARIABLES:
            raise ValueError(f"build_env may not set {name}: the variant's archs do (kiln.toml [[variants]] archs)")
        if "\0" in value or "\n" in value:
            raise ValueError(f"build_env {name}: the value holds a NUL or newline")
    return dict(sorted(env.items()))


class Toolchain(_Model):
    """What Kiln's nvcc builds add to the fixed command, and what a project build sees.

    For ``backend = "pep517"`` the same settings reach the project's compilers
    through the environment (``NVCC_APPEND_FLAGS``, ``HIPCC_COMPILE_FLAGS_APPEND``).
    """

    include_dirs: tuple[LocalPath, ...] = ()  # absolute, or relative to kiln.toml
    # Preprocessor definitions for Kiln's nvcc/hipcc compiles (NAME or NAME=VALUE).
    defines: tuple[Annotated[str, AfterValidator(_define)], ...] = ()
    nvcc_flags: tuple[Flag, ...] = ()  # extra flags for Kiln's nvcc compiles
    hipcc_flags: tuple[Flag, ...] = ()  # extra flags for Kiln's hipcc compiles
    # Libraries Kiln's compiled libraries link against (-l).
    libraries: tuple[Annotated[str, AfterValidator(_library)], ...] = ()
    library_dirs: tuple[LocalPath, ...] = ()  # folders searched for them (-L)
    # CUDA sources that register torch ops (TORCH_LIBRARY): built against the installed
    # torch's headers, libraries and C++ ABI.
    torch: bool = False


# Where the unit cache's second tier lives, under the worker's own directory: "artifacts" is the artifact store
# ([artifacts]: s3:// for a team, a shared file:// path), so any worker's hit is every worker's; "none" keeps
# the cache local to this worker.
CacheTier = Literal["artifacts", "none"]
CACHE_TIERS: tuple[str, ...] = get_args(CacheTier)


class BuildCacheSettings(_Model):
    """``[build.cache]``: the second tier of the content-addressed unit cache (kiln.tasks.build.cache_remote) and
    of the per-translation-unit compile cache (``<prefix>/compile/``, kiln.tasks.build.compile_tier).

    Objects are written create-only under their sha256 and every read is re-hashed, so a damaged or forged
    object is a miss that rebuilds; an unreachable store is a warning and a local-only build. ``read_only``
    (for builds of untrusted branches) reads the shared tier and never writes it. Only the build step's
    credentials may write ``prefix`` (kiln.release.stores.policies denies it to every other step).
    """

    # "artifacts": the artifact store ([artifacts]) is the unit and compile caches' second tier, shared by every
    # worker; "none": local only.
    remote: CacheTier = "none"
    # Where the shared tier lives in the artifact store: objects/<sha256>, entries/<batch>/<key>.json and the
    # compile cache's compile/ below it.
    prefix: StorePrefix = "build-cache"
    # Read the shared tier, never write it (builds of untrusted branches, or a role without its write right).
    read_only: bool = False
    # Also write the compile cache's local hits to the shared tier (ccache's reshare): a worker whose local cache
    # was filled before the tier existed, or against another store, shares it. One write per local hit.
    reshare: bool = False

    @field_validator("remote", mode="before")
    @classmethod
    def _known_tier(cls, value: object) -> object:
        return one_of(value, CACHE_TIERS, "a cache tier")

    @model_validator(mode="after")
    def _reshare_writes(self) -> BuildCacheSettings:
        if self.reshare and (self.read_only or self.remote == "none"):
            why = "read_only = true never writes it" if self.read_only else 'remote = "none" has none'
            raise ValueError(f"reshare = true writes local hits to the shared tier, and {why}")
        return self


class Build(_Model):
    cache_dir: LocalPath = ".kiln/cache"  # the content-addressed build cache, relative to kiln.toml
    # [build.cache]: the unit cache's shared tier, under the worker's own cache_dir.
    cache: BuildCacheSettings = BuildCacheSettings()
    jobs: int = Field(default=2, ge=1, le=256)  # compile units built at once (and the bound of a suite's "auto" shards)
    unit_timeout_s: float = Field(default=300, gt=0)  # the deadline of one compile unit
    # "kiln": Kiln's AOT build of the registry; "pep517": the project's own build backend.
    backend: BuildBackend = "kiln"
    # "triton-jit": a pep517 package whose Triton kernels compile at run time (no AOT step).
    kind: PackageKind = "native"
    # pep517: the directory holding the project's pyproject.toml, and the deadline of one variant's build.
    project_dir: ProjectPath = "."
    backend_timeout_s: float = Field(default=3600, gt=0)  # the deadline of one pep517 build
    # Package files (globs, relative to the package directory) left out of the wheel; each one is named in a warning.
    exclude: tuple[Annotated[str, AfterValidator(_pattern)], ...] = ()
    toolchain: Toolchain = Toolchain()  # what the build is compiled against (torch, include folders)
    # [build.interpreters]: "3.12" = "/path/to/python3.12", the interpreter of every cell of that Python,
    # before python3.X on PATH, uv's discovery and pyenv's versions (kiln.tasks.build.interpreters).
    interpreters: dict[str, LocalPath] = Field(default_factory=dict)
    # The manylinux a native wheel must meet ("2_28": glibc 2.28 and the libstdc++ of that policy): the wheel
    # is tagged for it, and one whose binaries need newer symbol versions fails its unit naming them
    # (kiln.tasks.wheel.manylinux). None: the tag is whatever the binaries allow on the build host.
    manylinux: str | None = None
    # Variables of the step's environment the package's build may see, each by name (its backend runs as a
    # guest: an allow-list, never a credential, identity or Prefect variable).
    pass_env: PassEnv = ()

    @field_validator("manylinux")
    @classmethod
    def _manylinux_target(cls, value: str | None) -> str | None:
        if value is None:
            return None
        major, _, minor = value.partition("_")
        if major != "2" or not minor.isdigit() or minor != str(int(minor)):
            raise ValueError(f"build.manylinux {value!r} is not a glibc target in the '2_NN' form (e.g. \"2_28\")")
        from auditwheel.architecture import Architecture
        from auditwheel.libc import Libc
        from auditwheel.policy import WheelPolicies

        arch = Architecture.detect()
        known = [policy.name.removeprefix("manylinux_").removesuffix(f"_{arch.value}")
                 for policy in WheelPolicies(libc=Libc.GLIBC, arch=arch) if policy.name.startswith("manylinux_")]
        if value not in known:
            raise ValueError(f"build.manylinux {value!r}: auditwheel has no manylinux_{value} policy to check it by"
                             f" (known: {', '.join(sorted(known, key=lambda k: int(k.split('_')[1])))})")
        return value

    @field_validator("interpreters")
    @classmethod
    def _minor_versions(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            check_python_axis([key])
        return dict(sorted(value.items()))

    @field_validator("kind", mode="before")
    @classmethod
    def _known_kind(cls, value: object) -> object:
        return one_of(value, PACKAGE_KINDS, "a package kind")


# A change to any of these may change every test: --changed-since then selects every suite.
DEFAULT_SELECT_ALL: tuple[str, ...] = (
    "pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "CMakeLists.txt", "uv.lock", "requirements.txt",
    "conftest.py",
)


class Quarantine(_Model):
    """``[testing.quarantine]``: when a test is flaky, and when it is trusted again (kiln.tasks.testing.flaky).

    Flaky: it passed and failed on one commit within its last ``window`` runs. A quarantined test still
    runs and is reported, but its failure does not gate publishing; ``release_after`` consecutive passes
    end its quarantine, and so does the window passing its last same-commit pass and fail. A test that
    fails on ``broken_after`` consecutive commits is broken, not flaky: it leaves quarantine and gates.
    Per-test outcomes and the list live under ``history`` in the artifact store; each entry is checked
    against the run records it cites. ``min_runs``, ``band_low`` and ``band_high`` are no longer used (a
    fail rate across commits is not evidence of a flake) and are accepted with a warning.
    """

    window: int = Field(default=10, ge=2, le=200)  # the runs of a test the flaky judgment looks at
    min_runs: int = Field(default=3, ge=2)  # runs needed before a test can be judged flaky
    band_low: float = Field(default=0.05, gt=0, lt=1)  # a failure rate above this (and below band_high) is flaky
    band_high: float = Field(default=0.6, gt=0, lt=1)  # a failure rate at or above this is broken, not flaky
    release_after: int = Field(default=3, ge=1, le=100)  # consecutive passes that release a test from quarantine
    broken_after: int = Field(default=3, ge=2, le=50)  # consecutive failures that make a quarantined test gate again
    history: StorePrefix = "test-history"  # the artifact-store prefix test outcomes are kept under
    enabled: bool = True  # whether flaky tests are quarantined at all

    @model_validator(mode="after")
    def _fits(self) -> Quarantine:
        if self.min_runs > self.window:
            raise ValueError(f"min_runs ({self.min_runs}) cannot exceed window ({self.window})")
        if self.band_low > self.band_high:
            raise ValueError(f"band_low ({self.band_low}) cannot exceed band_high ({self.band_high})")
        unused = sorted(self.model_fields_set & {"min_runs", "band_low", "band_high"})
        if unused:
            _log.warning("testing.quarantine: %s no longer decide anything (only a pass and a fail on one commit "
                         "quarantine a test); remove them", ", ".join(unused))
        return self


class Selection(_Model):
    """``[testing.selection]``: which tests a run carries instead of running (kiln.tasks.testing.selection).

    A test is carried — reported passed, naming the run it ran in — when its last outcome was a pass, it is not
    quarantined, and every input its last run recorded (the wheel members it touched by sha256, its test file and
    conftests, its environment's lock) is unchanged; otherwise it runs. ``kiln nightly --full``, ``kiln test
    --full`` and a release run every test. A full run is also a recall check: a test selection would have
    carried that fails turns selection off for its suite until ``kiln test --selection-on SUITE``.
    Records live under ``[testing.quarantine] history``/selection/ in the artifact store.
    """

    enabled: bool = Field(default=True, description="carry tests whose recorded inputs are unchanged; false: every "
                                                    "run runs every test")
    max_age_days: float = Field(default=7, gt=0, description="a test runs at least once in this many days, "
                                                             "whatever it touched")
    max_carries: int = Field(default=10, ge=1, le=1000, description="a test runs at least once in this many runs "
                                                                    "(it is carried at most this many times in a row)")


class Testing(_Model):
    # Files or directories (relative to kiln.toml) whose change selects every suite; kiln.toml itself always does.
    select_all: tuple[ProjectPath, ...] = DEFAULT_SELECT_ALL
    quarantine: Quarantine = Quarantine()  # how flaky tests are found, quarantined and released
    selection: Selection = Selection()  # which tests a nightly carries from an earlier run instead of running
