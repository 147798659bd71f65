"""Which variants a compiling package's build can make, and the switches each needs (pure: reads files only).

:func:`native_code` says whether (and how) a package compiles; :func:`native_build` reads the switches its
build reads (:mod:`kiln.tasks.onboarding.switches`) and decides from them and from what it compiles: a GPU
variant where device code or a CUDA runtime link is built, a CPU variant only where a CPU path exists (naming
the switch that opens it), the portable wheel of an optional-ops package beside its prebuilt-ops one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.tasks.onboarding.defaults import load_defaults
from kiln.tasks.onboarding.names import parse_setup_py
from kiln.tasks.onboarding.switches import Switches, read_switches

TORCH_EXT = re.compile(r"\b(CUDAExtension|CppExtension|BuildExtension|torch\.utils\.cpp_extension)\b")
_CPP_EXTENSION = re.compile(r"\btorch\.utils\.cpp_extension\b")  # what BuildExtension alone may not be: torch's
_IMPORTS_TORCH = re.compile(r"^\s*(import torch\b|from torch[.\s])", re.M)
_NATIVE_BUILD = re.compile(r"\b(nvcc|Extension\(|cmake|CMakeBuild|ext_modules)\b", re.I)
_NATIVE_BACKENDS = ("scikit_build_core", "mesonpy", "cmake_build_extension", "py_build_cmake")
_CMAKE_TORCH = re.compile(r"find_package\s*\(\s*Torch\b")
_CMAKE_CUDA = re.compile(r"LANGUAGES[^)]*\bCUDA\b|enable_language\s*\(\s*CUDA|find_package\s*\(\s*CUDAToolkit")
_SETUP_CMAKE = re.compile(r"\bcmake\b|CMakeBuild|CMakeExtension", re.I)
_NOT_CMAKE_DIRS = {"tests", "test", "docs", "examples", "benchmarks", "build", "dist", "third_party"}


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    except OSError:
        return ""


@dataclass(frozen=True)
class NativeBuild:
    why: str
    torch_extension: bool
    cuda_build: bool
    cpu_build: bool
    gpu_env: tuple[tuple[str, str], ...]
    cpu_env: tuple[tuple[str, str], ...]
    reasons: tuple[str, ...]
    also_read: tuple[str, ...]
    assumed: tuple[str, ...]


def _cmake_text(root: Path) -> str:
    """Its CMake files (the top one, ``cmake/*.cmake`` and those two folders down), read as one text."""
    files = [root / "CMakeLists.txt", *sorted(root.glob("cmake/*.cmake")), *sorted(root.glob("*/CMakeLists.txt")),
             *sorted(root.glob("*/*/CMakeLists.txt"))]
    return "\n".join(_text(f) for f in files if not any(part in _NOT_CMAKE_DIRS for part in
                                                         f.relative_to(root).parts[:-1]))


def native_code(root: Path, pyproject: dict[str, Any], setup_py: str) -> tuple[bool, bool, str]:
    """(builds native code, is a torch extension, why)."""
    backend = str(pyproject.get("build-system", {}).get("build-backend", ""))
    cmake = _text(root / "CMakeLists.txt")
    if _SETUP_CMAKE.search(setup_py) and _cmake_text(root).strip():  # a cpp_extension import is for CUDA_HOME
        return True, bool(_CMAKE_TORCH.search(_cmake_text(root)) or _CPP_EXTENSION.search(setup_py)), (
            "setup.py drives a CMake build (its CMakeLists.txt)")
    if TORCH_EXT.search(setup_py):
        return True, True, "setup.py builds a torch C++/CUDA extension (torch.utils.cpp_extension)"
    if _CMAKE_TORCH.search(cmake):
        return True, True, "CMakeLists.txt builds against torch (find_package(Torch))"
    if any(backend.startswith(b) for b in _NATIVE_BACKENDS):
        return True, False, f"its build backend {backend!r} compiles native code"
    if (root / "CMakeLists.txt").is_file():
        return True, False, "a CMakeLists.txt builds native code"
    if pyproject.get("tool", {}).get("setuptools", {}).get("ext-modules"):
        return True, False, "pyproject.toml declares C extensions ([tool.setuptools] ext-modules)"
    if _NATIVE_BUILD.search(setup_py):
        return True, False, "setup.py compiles native code (nvcc, Extension or CMake)"
    return False, False, ""


def _cuda_sources(root: Path) -> bool:
    return any(p.suffix in (".cu", ".cuh") for p in root.rglob("*.cu*")
               if not any(part.startswith(".") for part in p.relative_to(root).parts))


def _cuda_of(variant: str) -> str:
    """``"cu130"`` -> ``"13.0"``, the CUDA version a default variant's name says."""
    match = re.fullmatch(r"cu(\d+)(\d)", variant)
    return f"{match.group(1)}.{match.group(2)}" if match else "13.0"


def _variants(root: Path, switches: Switches, torch_ext: bool, cmake: str) -> tuple[bool, bool, list[str]]:
    """(a GPU variant, a CPU variant, why) from what the build compiles and the switches it reads."""
    toggle = switches.role("cuda_toggle")
    ops = switches.role("build_ops")
    notes: list[str] = []
    opened = f"a CPU variant: {toggle[0].name}={dict(switches.cpu_env)[toggle[0].name]} opens its CPU path" if (
        toggle) else ""
    if switches.cuda_extension or switches.cpu_extension:
        cuda = switches.cuda_extension or switches.cudart
        cpu = (switches.cpu_extension and not (switches.cudart and not switches.cuda_extension)) or bool(toggle)
        if not cuda:
            notes.append("no GPU variant: setup.py builds a CppExtension and no CUDAExtension (no device code)")
        elif not switches.cuda_extension:
            notes.append("a GPU variant: its CppExtension links the CUDA runtime (cudart), with no .cu file")
    else:
        requires = bool(switches.cudart or [r for r in switches.role("cuda_version") if r.required])
        cuda = (_cuda_sources(root) or torch_ext or requires or bool(_CMAKE_CUDA.search(cmake))
                or bool(switches.role("force_cuda") or toggle or ops))
        cpu = not requires or bool(toggle)
        if requires and not cpu:
            notes.append("a GPU variant only: its build links the CUDA runtime or requires a CUDA version, and no"
                         " switch opens a CPU path")
    if ops and not cpu:
        cpu = True
        notes.append(f"a CPU variant: the portable wheel, built without {ops[0].name} (its ops compile at run time)")
    elif not cpu and cuda and switches.cuda_extension and not switches.cudart:
        notes.append("no CPU variant: setup.py builds a CUDAExtension and no CppExtension (no CPU path)")
    elif opened and cpu:
        notes.append(opened)
    return cuda, cpu, notes


def native_build(root: Path, pyproject: dict[str, Any], setup_py: str, why: str, torch_ext: bool) -> NativeBuild:
    """A package that compiles: GPU and CPU variants as far as its build can make each, and its switches."""

    defaults = load_defaults()
    cmake = _cmake_text(root)
    config = _text(root / "pyproject.toml") + "\n" + _text(root / "setup.cfg")
    switches = read_switches(setup_py, parse_setup_py(setup_py), cmake, config, defaults.extension_archs,
                             _cuda_of(defaults.cuda_variant), top_cmake=_text(root / "CMakeLists.txt"))
    if switches.role("build_ops") and _IMPORTS_TORCH.search(setup_py):  # its ops build against torch's headers
        torch_ext = True
    cuda, cpu, notes = _variants(root, switches, torch_ext, cmake)
    return NativeBuild(why, torch_ext, cuda, cpu, switches.gpu_env if cuda else (), switches.cpu_env if cpu else (),
                       (*switches.reasons, *notes), switches.also_read, switches.assumed if cuda else ())
