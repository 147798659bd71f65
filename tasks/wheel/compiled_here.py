"""Whether a ``pep517`` wheel's libraries were compiled by its build, for a backend that builds out of tree.

setuptools compiles into ``build/`` of the project it builds (:func:`kiln.tasks.build.backend.foreign_binaries`).
scikit-build-core (CMake) and meson-python (meson) build in a directory of their own, by default a temporary
one: Kiln names it (:func:`build_dir_options`) inside the unit's directory, so it is there when the wheel is
checked. A
library of the wheel is compiled here when a library with the same machine code (the ELF ``.text`` section: an
install's RPATH edit or strip leaves it unchanged) is in that build tree; one the build only installed from
elsewhere (a prebuilt ``.so`` in the sources, or fetched) is not, and fails the unit. A build that copies a
prebuilt library into its own build tree first is not told apart (a limit).
"""

from __future__ import annotations

import hashlib
import re
import struct
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path

# build-backend (its top-level module) -> the build system named in messages
OUT_OF_TREE = {"scikit_build_core": "CMake (scikit-build-core)", "mesonpy": "meson (meson-python)"}
BUILD_DIR = "native-build"  # under the unit's directory
_BINARY = re.compile(r"\.(so(\.[0-9]+)*|pyd|dylib)$")
_ELF64_LE = b"\x7fELF\x02\x01"


def build_backend(project_dir: Path) -> str:
    """The project's PEP 517 backend (setuptools' legacy one without a pyproject.toml or a build-backend)."""
    pyproject = project_dir / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text()) if pyproject.is_file() else {}
    return str(data.get("build-system", {}).get("build-backend", "setuptools.build_meta:__legacy__"))


def out_of_tree(project_dir: Path) -> str | None:
    """The build system of a backend that builds out of tree, which Kiln checks; ``None`` for any other."""
    return OUT_OF_TREE.get(build_backend(project_dir).split(".")[0].split(":")[0])


def build_dir_options(project_dir: Path, build_dir: Path,
                      environ: Mapping[str, str]) -> tuple[dict[str, str], list[str], Path | None]:
    """(variables, pip arguments, the build tree to check) that make the backend build in ``build_dir``;
    a scikit-build-core build directory the variant's environment already names is kept (and checked)."""
    backend = build_backend(project_dir).split(".")[0]
    if backend == "scikit_build_core":
        chosen = environ.get("SKBUILD_BUILD_DIR") or str(build_dir)
        return {"SKBUILD_BUILD_DIR": chosen}, [], Path(chosen)
    if backend == "mesonpy":
        return {}, [f"--config-settings=build-dir={build_dir}"], build_dir
    return {}, [], None


def code_digest(data: bytes) -> str:
    """sha256 of a 64-bit little-endian ELF's ``.text`` section, else of the whole file."""
    try:
        if data.startswith(_ELF64_LE):
            shoff = struct.unpack_from("<Q", data, 0x28)[0]
            entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
            names_offset = struct.unpack_from("<Q", data, shoff + names_index * entsize + 0x18)[0]
            for index in range(count):
                name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + index * entsize)
                start = names_offset + name
                if data[start:data.index(b"\0", start)] == b".text":
                    return hashlib.sha256(data[offset:offset + size]).hexdigest()
    except (struct.error, ValueError):
        pass  # not an ELF this reads: the whole file
    return hashlib.sha256(data).hexdigest()


def foreign_out_of_tree(wheel: Path, build_dir: Path) -> list[str]:
    """The libraries of ``wheel`` whose machine code is in no library of the build tree ``build_dir``."""
    with zipfile.ZipFile(wheel) as archive:
        members = {n: code_digest(archive.read(n)) for n in archive.namelist() if _BINARY.search(n)}
    if not members:
        return []
    built = {code_digest(p.read_bytes()) for p in build_dir.rglob("*")
             if p.is_file() and not p.is_symlink() and _BINARY.search(p.name)} if build_dir.is_dir() else set()
    return sorted(n for n, digest in members.items() if digest not in built)
