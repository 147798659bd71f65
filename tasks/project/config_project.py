"""``[project]`` of kiln.toml: the package the wheels ship, its names, version, dependencies and page status.

Part of :class:`kiln.tasks.project.config.KilnConfig`, validated with it at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidName, canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from kiln.core.errors import InvalidInputError
from kiln.release.index.render import ProjectStatus, Status
from kiln.tasks.project.config_fields import ProjectPath


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def requirement(value: str) -> str:
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
    dependencies: tuple[Annotated[str, AfterValidator(requirement)], ...] = ()
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


def pinned_version(requirements: Sequence[str], name: str = "torch") -> str | None:
    """The version ``requirements`` pin ``name`` to exactly (``torch==2.14.1`` -> ``2.14.1``), else None."""
    for text in requirements:
        req = Requirement(text)
        specs = list(req.specifier)
        if canonicalize_name(req.name) == name and len(specs) == 1 and specs[0].operator in ("==", "===") \
                and "*" not in specs[0].version:
            return specs[0].version
    return None


def requires(requirements: Sequence[str], name: str) -> bool:
    """Whether ``requirements`` name the distribution ``name`` (canonical), whatever version they ask."""
    return any(canonicalize_name(Requirement(r).name) == name for r in requirements)
