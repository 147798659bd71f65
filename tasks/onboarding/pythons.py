"""``kiln init``'s Python axis: the package's ``requires-python`` ∩ the CPythons found on this machine.

A package that builds its own CPython extension (``pep517``, no torch) gets ``python = [...]`` on each of its
variants: every supported CPython that its ``requires-python`` admits and that
:func:`kiln.tasks.build.interpreters.find_interpreter` finds here (the build's own search, so what init
writes is what the build finds). Each supported Python left out is named in a comment with why (the package
does not support it, or it is not installed here and how to add it). A torch extension gets the same
findings as a comment only: each cell would need its own torch for that Python. A Kiln-built (registry) or
pure-Triton package's wheels are ``py3``: no axis.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.specifiers import SpecifierSet

from kiln.tasks.build.interpreters import Interpreter, find_interpreter

# The CPythons Kiln builds a matrix for (the oldest still supported upstream, the newest released).
SUPPORTED = ("3.10", "3.11", "3.12", "3.13", "3.14")
Finder = Callable[[str], Interpreter | None]
# setuptools' Extension( (not CUDAExtension/CppExtension: those are torch extensions) or an ext_modules list.
_CPYTHON_EXTENSION = re.compile(r"\bExtension\(|\bext_modules\b")


def _find(minor: str) -> Interpreter | None:
    return find_interpreter(minor, {}, Path("."))[0]


def python_axis(requires_python: str, find: Finder = _find) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the Pythons of the axis, one line per supported Python left out saying why)."""
    spec = SpecifierSet(requires_python)
    admitted = [minor for minor in SUPPORTED if spec.contains(f"{minor}.0", prereleases=True)
                or spec.contains(f"{minor}.99", prereleases=True)]
    left = [f"{minor}: requires-python {requires_python!r} excludes it" for minor in SUPPORTED
            if minor not in admitted]
    with ThreadPoolExecutor(max_workers=max(1, len(admitted))) as pool:  # each search waits on processes
        found = dict(zip(admitted, pool.map(find, admitted), strict=True))
    left += [f"{minor}: no CPython {minor} found here (uv python install {minor}, or pyenv; or name it in"
             f" [build.interpreters])" for minor, interpreter in found.items() if interpreter is None]
    return tuple(m for m, interpreter in found.items() if interpreter is not None), tuple(left)


def cpython_extension(root: Path) -> bool:
    """Whether the project at ``root`` builds a CPython extension module (setuptools ``Extension``/``ext_modules``,
    or ``[tool.setuptools] ext-modules``): its wheel is per Python. A library it compiles and loads itself (nvcc,
    CMake, ctypes) is not, and gets no axis."""
    pyproject = root / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text()) if pyproject.is_file() else {}
    if data.get("tool", {}).get("setuptools", {}).get("ext-modules"):
        return True
    setup_py = root / "setup.py"
    return bool(_CPYTHON_EXTENSION.search(setup_py.read_text(errors="replace") if setup_py.is_file() else ""))


def with_python_axis(text: str, kind: str, torch_extension: bool, requires_python: str, root: Path,
                     find: Finder = _find) -> str:
    """``text`` (a rendered kiln.toml) with the Python axis on each variant of a ``pep517`` package that builds
    a CPython extension (a pure package's or a ctypes library's one ``py3`` wheel needs no axis)."""
    if kind != "pep517" or not cpython_extension(root):
        return text
    axis, left = python_axis(requires_python, find)
    notes = [f"# left out of the python axis: {line}" for line in left]
    quoted = ", ".join(f'"{p}"' for p in axis)
    lines, out = text.split("\n"), []
    in_variant = False
    for line in lines:
        out.append(line)
        if line.startswith("["):
            in_variant = line.strip() == "[[variants]]"
        elif in_variant and line.startswith("name = "):
            if not axis:
                out.append("# no python axis: no supported CPython found here for it")
            elif torch_extension:
                out.append(f"# python = [{quoted}]   # Pythons found here; each cell needs its own torch for it")
            else:
                out.append(f"python = [{quoted}]   # one wheel per CPython (kiln.toml matrix axes)")
            out += notes
            in_variant = False
    return "\n".join(out)
