"""``kiln.toml`` → frozen, typed settings, validated once at the edge.

Nothing deeper in the pipeline reads raw TOML or environment variables: it
takes a :class:`KilnConfig`. Every problem becomes a :class:`ConfigError`
that names the key (with a did-you-mean for typos) before anything starts.

This module holds the whole file's model (the rules across its tables) and its
loading; each table's model is in a sibling named for it (``config_project``,
``config_variant``, ``config_suites``, ``config_publish``, ``config_build``,
``config_pools``, ``config_permissions``, ``config_matrix``), and every name
of them that callers use is exported here.
"""

from __future__ import annotations

import difflib
import hashlib
import threading
import tomllib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.core.errors import ConfigError
from kiln.core.steps import STEPS, Step
from kiln.tasks.project.config_build import ArchPolicy, Build, Testing, Toolchain, check_build_env, one_of
from kiln.tasks.project.config_matrix import Cell, Exclusion, expand, has_axes
from kiln.tasks.project.config_permissions import Credentials, Permission, unchosen_credentials
from kiln.tasks.project.config_pools import Pools
from kiln.tasks.project.config_project import Project
from kiln.tasks.project.config_publish import CHANNELS, Channel, Publish, PublishRetention, Target, UploadTarget
from kiln.tasks.project.config_suites import (
    BENCH_SIZES,
    SUITE_RENAMES,
    Bench,
    BenchSize,
    Metric,
    RegressionPolicy,
    Suite,
    renamed_keys,
)
from kiln.tasks.project.config_variant import PLATFORMS, Backend, Platform, TorchAbi, Variant, check_platforms

__all__ = [
    "BENCH_SIZES", "CHANNELS", "PLATFORMS", "STEPS", "SUITE_RENAMES", "ArchPolicy", "Backend", "Bench", "BenchSize",
    "Build", "Cell", "Channel", "Credentials", "Exclusion", "KilnConfig", "Metric", "Permission", "Platform", "Pools",
    "Project", "Publish", "PublishRetention", "RegressionPolicy", "Step", "Suite", "Target", "Testing", "Toolchain",
    "TorchAbi", "UploadTarget", "Variant", "check_build_env", "check_platforms", "load_config", "one_of",
    "parse_config", "renamed_keys", "unchosen_credentials",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        if any(has_axes(v) for v in self.variants):
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
