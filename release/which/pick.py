"""Which wheel of a project fits one environment (``kiln which``): pure selection.

An :class:`Environment` is what a user's machine offers on each axis — Python, the wheel tags it accepts
(interpreter, abi, platform, in preference order, as :mod:`packaging.tags` computes them), torch, the GPU
backend (CUDA or ROCm and its version, or none) and the GPU arch. A :class:`Candidate` is one wheel of the
index with what it asks on each axis: ``Requires-Python``, its tags, the torch its ``Requires-Dist``
names, the backend of its local label (``+cu130`` is CUDA 13.0, ``+rocm6.4`` ROCm 6.4, ``+cpu`` none; no
label or another label: any backend) and the archs it was built for when the index states them.

:func:`select` answers with a :class:`Choice` (the best fitting wheel of the version) or a :class:`Miss`
whose reasons name, per axis, what the closest wheels ask instead. Nothing here reads a page or imports
torch: :mod:`kiln.release.which.reading` builds both sides.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename
from packaging.version import Version

# The GPU backends by the names kiln.toml gives them (a variant's backend = "cuda" | "hip" | "cpu"): "hip" is
# AMD's, whose versions are ROCm's (--rocm 6.4, +rocm6.4, torch.version.hip).
BackendKind = Literal["cuda", "hip", "cpu", "any"]
Axis = Literal["python", "tags", "backend", "torch", "arch"]
_AXES: tuple[Axis, ...] = ("python", "tags", "backend", "torch", "arch")
# A Kiln variant's local label starts with its backend (the variant's name: cu130, rocm6.4, cpu), and may
# carry more after it (+cu130torch2.14). Kiln's naming convention, not a packaging grammar.
_CUDA_LABEL = re.compile(r"cu(\d{2,4})")
_ROCM_LABEL = re.compile(r"rocm(\d+(?:\.\d+)*)")


@dataclass(frozen=True)
class Backend:
    kind: BackendKind
    version: Version | None = None  # CUDA or ROCm version; None for cpu and any

    def __str__(self) -> str:
        names = {"cuda": "CUDA", "hip": "ROCm", "cpu": "no GPU backend (cpu)", "any": "any backend"}
        return f"{names[self.kind]} {self.version}" if self.version is not None else names[self.kind]


def label_backend(local: str | None) -> Backend:
    """The backend a local label names: ``cu130`` -> CUDA 13.0 (the last digit is the minor), ``rocm6.4``,
    ``cpu``; no label, or a label that names none of them, fits any backend."""
    if not local:
        return Backend("any")
    if cuda := _CUDA_LABEL.match(local):
        digits = cuda.group(1)
        return Backend("cuda", Version(f"{digits[:-1]}.{digits[-1]}"))
    if rocm := _ROCM_LABEL.match(local):
        return Backend("hip", Version(rocm.group(1)))
    return Backend("cpu") if local.startswith("cpu") else Backend("any")


@dataclass(frozen=True)
class Environment:
    python: Version  # major.minor[.micro]
    tags: tuple[Tag, ...]  # accepted tags, most preferred first
    torch: Version | None  # None: no torch installed (pip installs the one the wheel asks for)
    backend: Backend  # cuda/hip with a version, or cpu
    arch: str | None = None  # "9.0"; None: no GPU visible, not checked

    def describe(self) -> str:
        torch = f"torch {self.torch}" if self.torch is not None else "no torch"
        arch = f", arch {self.arch}" if self.arch else ""
        return f"Python {self.python}, {self.tags[0] if self.tags else 'no tags'}, {torch}, {self.backend}{arch}"


@dataclass(frozen=True)
class Candidate:
    filename: str
    requires_python: SpecifierSet | None
    torch: SpecifierSet | None  # the torch its Requires-Dist names; None: it names none
    archs: frozenset[str] | None = None  # None: the index does not say

    @property
    def version(self) -> Version:
        return parse_wheel_filename(self.filename)[1]

    @property
    def tags(self) -> frozenset[Tag]:
        return parse_wheel_filename(self.filename)[3]

    @property
    def backend(self) -> Backend:
        return label_backend(self.version.local)

    def describe(self) -> str:
        return f"{parse_wheel_filename(self.filename)[0]} {self.version}"


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    unchecked: tuple[str, ...]  # axes that could not be checked, and why


@dataclass(frozen=True)
class Miss:
    reasons: tuple[str, ...]  # one per axis the closest wheels miss, naming what they ask


def _backend_fits(want: Backend, have: Backend) -> bool:
    if have.kind == "any":
        return True
    if want.kind != have.kind:
        return False
    if want.version is None or have.version is None:
        return True
    # CUDA's and ROCm's minor-version compatibility: built against X.y, it runs on X.z for z >= y
    return want.version.major == have.version.major and have.version <= want.version


def _arch_fits(want: str, archs: frozenset[str]) -> bool:
    """A cubin for major.minor runs on the same major at that minor or above."""
    major, _, minor = want.partition(".")
    for arch in archs:
        have_major, _, have_minor = arch.rstrip("af").partition(".")
        if have_major == major and have_minor.isdigit() and minor.isdigit() and int(have_minor) <= int(minor):
            return True
    return False


def _failing(env: Environment, candidate: Candidate) -> list[Axis]:
    failing: list[Axis] = []
    if candidate.requires_python is not None and not candidate.requires_python.contains(env.python, prereleases=True):
        failing.append("python")
    if not candidate.tags & set(env.tags):
        failing.append("tags")
    if not _backend_fits(env.backend, candidate.backend):
        failing.append("backend")
    if env.torch is not None and candidate.torch is not None and not candidate.torch.contains(env.torch,
                                                                                               prereleases=True):
        failing.append("torch")
    if env.arch and candidate.archs is not None and not _arch_fits(env.arch, candidate.archs):
        failing.append("arch")
    return failing


def _rank(env: Environment, candidate: Candidate) -> tuple[int, int]:
    """Lower is better: an exact backend before a portable wheel, then the most preferred tag."""
    tag_rank = min(env.tags.index(tag) for tag in candidate.tags if tag in env.tags)
    return (0 if candidate.backend.kind == env.backend.kind else 1, tag_rank)


def _version_key(version: Version | None) -> Version:
    return version if version is not None else Version("0")


def _unchecked(env: Environment, candidate: Candidate) -> tuple[str, ...]:
    notes = []
    if env.torch is None and candidate.torch is not None:
        notes.append(f"no torch here: installing it brings torch{candidate.torch}")
    if env.arch and candidate.archs is None and candidate.backend.kind in ("cuda", "hip"):
        notes.append(f"arch {env.arch} not checked: the index does not say which archs {candidate.filename} has")
    return tuple(notes)


def select(env: Environment, candidates: Sequence[Candidate]) -> Choice | Miss:
    """The best wheel among ``candidates`` (one version's wheels) for ``env``, or why none fits."""
    if not candidates:
        return Miss(("the index has no wheel of that version",))
    failures = {c: _failing(env, c) for c in candidates}
    fitting = [c for c, failing in failures.items() if not failing]
    if fitting:
        newest_backend_first = sorted(fitting, key=lambda c: (_version_key(c.backend.version), c.filename),
                                      reverse=True)
        best = min(newest_backend_first, key=lambda c: _rank(env, c))
        return Choice(best, _unchecked(env, best))
    fewest = min(len(f) for f in failures.values())
    closest = [c for c, failing in failures.items() if len(failing) == fewest]
    axes = [axis for axis in _AXES if any(axis in failures[c] for c in closest)]
    return Miss(tuple(_reason(axis, env, [c for c in closest if axis in failures[c]], candidates) for axis in axes))


def _reason(axis: Axis, env: Environment, missing: Sequence[Candidate], every: Sequence[Candidate]) -> str:
    """What the closest wheels that miss ``axis`` ask instead."""
    first = missing[0]
    if axis == "python":
        return f"no wheel for Python {env.python}: {first.describe()} requires-python {first.requires_python}"
    if axis == "tags":
        return _tags_reason(env, every)
    if axis == "backend":
        has = ", ".join(sorted({f"+{c.version.local} ({c.backend})" for c in every if c.version.local}))
        return f"no wheel for {env.backend}: {first.describe().split(' ')[0]} {first.version.public} has {has}"
    if axis == "torch":
        if floor := _stable_floor(missing):
            return f"no wheel for torch {env.torch}: this release covers torch>={floor} (stable ABI)"
        return f"no wheel for torch {env.torch}: {first.describe()} requires torch{first.torch}"
    archs = ", ".join(sorted(first.archs or ()))
    return f"no wheel for arch {env.arch}: {first.describe()} is built for {archs}"


def _stable_floor(missing: Sequence[Candidate]) -> Version | None:
    """The lowest torch the wheels cover when each asks only a floor of torch (``torch>=2.13``: a LibTorch
    stable-ABI wheel, which Kiln writes that way; an exact one pins ``torch==2.14.*``); else None."""
    floors = []
    for candidate in missing:
        specifiers = list(candidate.torch or ())
        if not specifiers or any(s.operator != ">=" for s in specifiers):
            return None
        floors.append(max(Version(s.version) for s in specifiers))
    return min(floors, default=None)


def _tags_reason(env: Environment, every: Sequence[Candidate]) -> str:
    accepted = {(tag.interpreter, tag.abi) for tag in env.tags}
    if not any((tag.interpreter, tag.abi) in accepted for c in every for tag in c.tags):
        have = sorted({tag.interpreter if tag.abi in ("none", tag.interpreter) else f"{tag.interpreter}-{tag.abi}"
                       for c in every for tag in c.tags})
        return f"no {env.tags[0].interpreter} wheel: the index has {', '.join(have)} only"
    platforms = sorted({tag.platform for c in every for tag in c.tags if (tag.interpreter, tag.abi) in accepted})
    return f"no wheel for platform {env.tags[0].platform}: the index has {', '.join(platforms)} only"
