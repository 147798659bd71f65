"""``kiln.toml`` → frozen, typed settings, validated once at the edge.

Nothing deeper in the pipeline reads raw TOML or environment variables: it
takes a :class:`KilnConfig`. Every problem becomes a :class:`ConfigError`
that names the key (with a did-you-mean for typos) before anything starts.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from release.errors import ConfigError, InvalidInputError
from tasks.archs import validate_arch

Backend = Literal["cuda", "hip", "cpu"]
Step = Literal["build", "test", "bench", "publish-nightly", "publish-release"]
STEPS: tuple[str, ...] = ("build", "test", "bench", "publish-nightly", "publish-release")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Project(_Model):
    package: str
    distribution: str
    version: str
    source: str
    registry: str
    requires_python: str = ">=3.10"
    dependencies: tuple[str, ...] = ()

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
    def _entry_point(cls, value: str) -> str:
        module, _, attr = value.partition(":")
        if not module or not attr:
            raise ValueError(f"{value!r} must be 'module:attribute'")
        return value


class Variant(_Model):
    name: str = Field(pattern=r"^[a-z][a-z0-9]*$")
    backend: Backend
    archs: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _archs(self) -> "Variant":
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


class Build(_Model):
    cache_dir: str = ".kiln/cache"
    jobs: int = Field(default=2, ge=1, le=256)
    unit_timeout_s: float = Field(default=300, gt=0)


class Suite(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    paths: tuple[str, ...]
    markers: str = ""
    gpus: int = Field(default=0, ge=0)
    depends: tuple[str, ...] = ()
    required: bool = True
    timeout_s: float = Field(default=300, gt=0)
    # A GPU work pool: the nightly dispatches this suite to the pool's
    # "test/gpu-tests-<pool>" deployment when the server has it, else runs it here.
    pool: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    deadline_s: float = Field(default=3600, gt=0)  # the whole suite, when dispatched


class Bench(_Model):
    size: Literal["small", "large"] = "small"
    threshold: float = Field(default=0.05, gt=0, lt=10)
    history: str = "bench-history"


class Target(_Model):
    url: str
    region: str | None = None
    endpoint: str | None = None
    expected_owner: str | None = Field(default=None, pattern=r"^[0-9]{12}$")

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value.startswith("file://"):
            if not value[len("file://"):]:
                raise ValueError(f"{value!r} names no directory")
            return value
        if value.startswith("s3://"):
            bucket = value[len("s3://"):].split("/", 1)[0]
            if not bucket:
                raise ValueError(f"{value!r} names no bucket")
            return value
        raise ValueError(f"{value!r} must start with file:// or s3://")

    @property
    def kind(self) -> Literal["file", "s3"]:
        return "s3" if self.url.startswith("s3://") else "file"


class Publish(_Model):
    default_target: str = "local"
    channels: dict[Literal["nightly", "release"], str] = {"nightly": "nightly", "release": "release"}
    targets: dict[str, Target] = {}

    @model_validator(mode="after")
    def _default_exists(self) -> "Publish":
        if self.default_target not in self.targets:
            raise ValueError(f"default_target {self.default_target!r} is not one of {sorted(self.targets)}")
        return self


class Credentials(_Model):
    """Where a step's store credentials come from; exactly one source."""

    block: str | None = None
    role_arn: str | None = None
    ambient: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> "Credentials":
        chosen = [n for n, v in (("block", self.block), ("role_arn", self.role_arn), ("ambient", self.ambient)) if v]
        if len(chosen) != 1:
            raise ValueError(f"give exactly one of block, role_arn, ambient = true (got {chosen or 'none'})")
        return self


class Permission(_Model):
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    credentials: Credentials = Credentials(ambient=True)


class KilnConfig(_Model):
    project: Project
    variants: tuple[Variant, ...]
    build: Build = Build()
    suites: tuple[Suite, ...] = ()
    bench: Bench = Bench()
    artifacts: Target = Target(url="file://.kiln/artifacts")
    publish: Publish
    permissions: dict[Step, Permission] = {}
    root: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> "KilnConfig":
        for kind, names in (("variant", [v.name for v in self.variants]), ("suite", [s.name for s in self.suites])):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"duplicate {kind} names: {dupes}")
        return self

    @property
    def suites_by_name(self) -> dict[str, Suite]:
        return {suite.name: suite for suite in self.suites}

    def variant(self, name: str) -> Variant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise ConfigError(f"unknown variant {name!r}; kiln.toml defines {[v.name for v in self.variants]}")

    def path(self, relative: str) -> Path:
        """A path from kiln.toml, resolved against the file's directory."""
        return (self.root / relative).resolve()


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
        if error["type"] == "extra_forbidden":
            known = [k for k in _field_names(KilnConfig, loc) if k != "root"]
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else (f"; known keys: {', '.join(known)}" if known else "")
            lines.append(f"unknown key {key!r}{suggestion}")
        elif error["type"] == "missing":
            lines.append(f"missing key {key!r}")
        else:
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {message}")
    return ConfigError(f"{source} is invalid:\n  - " + "\n  - ".join(lines))


def _check_paths(config: KilnConfig, source: str) -> None:
    missing = []
    if not config.path(config.project.source).is_dir():
        missing.append(f"project.source = {config.project.source!r}")
    for index, suite in enumerate(config.suites):
        for path in suite.paths:
            if not config.path(path).exists():
                missing.append(f"suites[{index}].paths: {path!r} (suite {suite.name!r})")
    if missing:
        raise ConfigError(f"{source} names paths that do not exist (relative to {config.root}):\n  - " + "\n  - ".join(missing))


def parse_config(data: dict[str, Any], root: Path, source: str = "kiln.toml") -> KilnConfig:
    try:
        config = KilnConfig.model_validate({**data, "root": root.resolve()})
    except ValidationError as exc:
        raise _explain(exc, source) from None
    _check_paths(config, source)
    return config


def load_config(path: str | Path = "kiln.toml") -> KilnConfig:
    """Read and validate ``kiln.toml``; raise :class:`ConfigError` on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (pass --config FILE)") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_config(data, path.parent, str(path))
