"""The device code a wheel's shared libraries embed, checked against the variant's arch list.

A wheel the project's own backend built is trusted for nothing: every shared
library in it that embeds device code must hold exactly the archs the variant
asked for — CUDA SASS and PTX read with ``cuobjdump``, ROCm code objects read
from the clang offload bundles in the library — or the unit fails naming what
is missing and what is extra. A library with no device code at all is host
code and is not judged, unless no library of a GPU variant carries any (then
the backend ignored the exported archs), and a ``cpu`` wheel may carry none.
"""

from __future__ import annotations

import re
import struct
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import CompileError
from kiln.core.wheels import copy_member
from kiln.tasks.process import run_tool
from kiln.tasks.project.archs import parse_cuda_arch, parse_rocm_arch

_LIST_TIMEOUT_S = 60
_ELF = re.compile(r"^ELF file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.cubin\s*$", re.M)
_PTX = re.compile(r"^PTX file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.ptx\s*$", re.M)
_NO_DEVICE_CODE = "does not contain device code"


def expected_contents(archs: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(SASS archs, PTX archs) a library built with :func:`gencode_flags` must embed."""
    parsed = [parse_cuda_arch(a) for a in archs]
    return {a.sm for a in parsed}, {a.sm for a in parsed if a.ptx}


def embedded_archs(library: Path, cuobjdump: str) -> tuple[set[str], set[str]]:
    """(SASS archs, PTX archs) embedded in ``library``, read with cuobjdump."""
    elf = run_tool([cuobjdump, "--list-elf", str(library)], _LIST_TIMEOUT_S)
    ptx = run_tool([cuobjdump, "--list-ptx", str(library)], _LIST_TIMEOUT_S)
    if elf.returncode != 0 and _NO_DEVICE_CODE in elf.stdout:
        return set(), set()  # host code only: the caller judges whether that is allowed
    if elf.returncode != 0:
        raise CompileError(f"cuobjdump could not read {library.name}: {elf.stdout[-500:]}")
    return set(_ELF.findall(elf.stdout)), set(_PTX.findall(ptx.stdout)) if ptx.returncode == 0 else set()


_LIBRARY = re.compile(r"\.so(\.[0-9]+)*$")
_BUNDLE = b"__CLANG_OFFLOAD_BUNDLE__"
_COMPRESSED = b"CCOB"
# The largest shared library Kiln inflates to check its device code (a zip without zip64 holds at most 4 GiB;
# torch's largest CUDA library is under 2 GiB).
MAX_LIBRARY_BYTES = 4 << 30


@dataclass(frozen=True)
class Contents:
    """Device code of one library: CUDA SASS (``sm_80``), CUDA PTX (``sm_80``), ROCm targets (``gfx942``)."""

    sass: frozenset[str] = frozenset()
    ptx: frozenset[str] = frozenset()
    gfx: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.sass or self.ptx or self.gfx)

    def describe(self) -> str:
        parts = [f"{label} {sorted(names)}" for label, names in (("SASS", self.sass), ("PTX", self.ptx),
                                                                  ("ROCm", self.gfx)) if names]
        return ", ".join(parts) or "no device code"


def expected(backend: str, archs: Sequence[str]) -> Contents:
    """What a library built for ``archs`` must embed (nothing for ``cpu``)."""
    if backend == "cuda":
        sass, ptx = expected_contents(tuple(archs))
        return Contents(frozenset(sass), frozenset(ptx))
    if backend == "hip":
        return Contents(gfx=frozenset(parse_rocm_arch(a) for a in archs))
    return Contents()


def rocm_targets(data: bytes, name: str = "library") -> frozenset[str]:
    """The gfx targets of every clang offload bundle in ``data`` (``hipv4-amdgcn-amd-amdhsa--gfx942:xnack-``)."""
    if _COMPRESSED + b"\x00" in data and _BUNDLE not in data:
        raise CompileError(f"{name}: its ROCm code objects are in a compressed offload bundle Kiln cannot list;"
                           " build without --offload-compress")
    targets = set()
    start = data.find(_BUNDLE)
    while start >= 0:
        pos = start + len(_BUNDLE)
        (count,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        for _ in range(min(count, 4096)):
            _offset, _size, length = struct.unpack_from("<QQQ", data, pos)
            ident = data[pos + 24:pos + 24 + length].decode("ascii", "replace")
            pos += 24 + length
            if "amdgcn" in ident and "--" in ident:
                targets.add(ident.rsplit("--", 1)[1].split(":")[0])
        start = data.find(_BUNDLE, pos)
    return frozenset(targets)


def library_contents(library: Path, cuobjdump: str | None) -> Contents:
    sass: set[str] = set()
    ptx: set[str] = set()
    if cuobjdump is not None:
        sass, ptx = embedded_archs(library, cuobjdump)
    return Contents(frozenset(sass), frozenset(ptx), rocm_targets(library.read_bytes(), library.name))


def wheel_contents(wheel: Path, cuobjdump: str | None, limit: int = MAX_LIBRARY_BYTES) -> dict[str, Contents]:
    """Every shared library in ``wheel`` (its arcname) and the device code it embeds.

    Each library is inflated streaming to a temporary file, at most ``limit`` bytes (checked against its zip
    header first): a library past it is a :class:`~kiln.core.errors.MemberTooLargeError` naming the wheel."""
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory(prefix="kiln-devicecode-") as tmp:
        found = {}
        for index, name in enumerate(n for n in sorted(archive.namelist()) if _LIBRARY.search(n)):
            path = Path(tmp) / f"{index}-{Path(name).name}"
            copy_member(archive, name, wheel.name, path, limit)
            found[name] = library_contents(path, cuobjdump)
    return found


def _difference(got: Contents, want: Contents, policy: str = "exact") -> str:
    lines = []
    for label, have, need in (("SASS", got.sass, want.sass), ("PTX", got.ptx, want.ptx), ("ROCm", got.gfx, want.gfx)):
        missing, extra = sorted(need - have), sorted(have - need)
        if missing:
            lines.append(f"missing {label} {missing}")
        if extra and policy in ("exact", "narrow"):
            lines.append(f"extra {label} {extra}")
    return "; ".join(lines)


def held(found: dict[str, Contents]) -> Contents:
    """Every arch the wheel's libraries hold together (what the build results record)."""
    return Contents(frozenset().union(*(c.sass for c in found.values())),
                    frozenset().union(*(c.ptx for c in found.values())),
                    frozenset().union(*(c.gfx for c in found.values())))


def check_wheel(wheel: Path, backend: str, archs: Sequence[str], cuobjdump: str | None, *, policy: str = "exact",
                variant: str = "") -> dict[str, Contents]:
    """Raise :class:`CompileError` unless the device code of ``wheel`` meets ``policy`` for ``archs``.

    ``exact``: every device-code library holds exactly ``archs``; ``at_least``: every one of them, extra
    archs allowed (a package that picks its own ``-gencode`` list); ``narrow``: as ``exact`` (Kiln's nvcc
    dropped the targets such a list names outside ``archs``); ``record``: whatever it holds. Under
    every policy a GPU variant's wheel must hold some device code: none at all (no shared library, or only
    host code) means the backend built nothing for the GPU.
    """
    want = expected(backend, archs)
    found = wheel_contents(wheel, cuobjdump)
    with_code = {name: got for name, got in found.items() if not got.empty}
    who = f"variant {variant}: " if variant else ""
    if backend != "cpu" and not found:
        raise CompileError(f"{who}{wheel.name} holds no shared library, so no {backend} device code at all (the"
                           f" variant asked for {want.describe()}); did the project skip its GPU build (a switch, a"
                           " missing toolkit), or is it a pure-Python package that has no GPU variant to build?")
    problems = []
    if policy != "record":
        problems = [f"{name}: {diff}" for name, got in sorted(with_code.items())
                    if (diff := _difference(got, want, policy))]
    if found and not with_code and not want.empty:
        problems.append(f"no shared library embeds device code ({', '.join(sorted(found))}): missing"
                        f" {want.describe()}")
    if problems:
        raise CompileError(f"{who}{wheel.name} does not hold the {backend} archs {list(archs)} the variant asked for"
                           f" (arch_policy {policy!r}; exported as TORCH_CUDA_ARCH_LIST/CMAKE_CUDA_ARCHITECTURES/"
                           f"PYTORCH_ROCM_ARCH; does the build ignore them?):\n  - " + "\n  - ".join(problems))
    return found
