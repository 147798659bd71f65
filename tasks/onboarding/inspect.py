"""What a package's repository says about how it builds and tests (pure: reads files, writes nothing).

:func:`inspect_project` looks at what is there — ``pyproject.toml`` or
``setup.py``, a src or flat layout, a ``CUDAExtension``/CMake/nvcc build, a
Kiln kernel registry, Triton imports, a tests folder, pytest markers — and
returns :class:`Findings`: each choice ``kiln init`` makes, with the reason it
was made (:mod:`kiln.tasks.onboarding.render` writes them as ``kiln.toml``).
"""

from __future__ import annotations

import configparser
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.release.errors import ConfigError

# registry: Kiln compiles the Triton kernels a kiln.runtime registry names (Kiln's own wheel builder);
# pep517: the package builds itself (setuptools, CMake, a torch C++/CUDA extension), one wheel per variant;
# triton-jit: a pure-Triton package, one portable wheel whose kernels compile at run time.
Kind = Literal["registry", "pep517", "triton-jit"]
KINDS: tuple[str, ...] = get_args(Kind)

_SKIP_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "benchmark", "benchmarks", "build", "dist",
              "scripts", "tools", "dev", "src", "csrc", "site-packages", "node_modules"}
_TRITON_KERNEL = re.compile(r"^\s*@triton\.(jit|autotune)\b", re.M)
_TRITON = re.compile(r"^\s*(import triton\b|from triton(\.| )\S*\s*import\b)", re.M)
_TORCH_EXT = re.compile(r"\b(CUDAExtension|CppExtension|BuildExtension|torch\.utils\.cpp_extension)\b")
_NATIVE_BUILD = re.compile(r"\b(nvcc|Extension\(|cmake|CMakeBuild|ext_modules)\b", re.I)
_NATIVE_BACKENDS = ("scikit_build_core", "mesonpy", "cmake_build_extension", "py_build_cmake")
# Tests written to run on the CPU too: they put Triton in interpreter mode where no GPU is.
_CPU_READY = re.compile(r"\bTRITON_INTERPRET\b")
_GPU_USE = re.compile(r"""["']cuda(:\d+)?["']|\.cuda\(|torch\.cuda\.|device\s*=\s*["']cuda""")
_CMAKE_TORCH = re.compile(r"find_package\s*\(\s*Torch\b")
# A literal compute capability in a -gencode flag: the build picks its own archs, whatever Kiln exports.
_OWN_ARCHS = re.compile(r"arch=compute_\d+|-arch=sm_\d+|CUDA_ARCHITECTURES\s+\"?\d")
_GPU_MARKERS = ("gpu", "cuda", "multi_gpu", "distributed")
_CONFTEST_MARKER = re.compile(r"""addinivalue_line\(\s*["']markers["']\s*,\s*["']([A-Za-z_][A-Za-z0-9_]*)""")
_SETUP_FIELD = r"""\b{0}\s*=\s*["']([^"']+)["']"""
_DUNDER_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


class OnboardingError(ConfigError):
    """``kiln init`` cannot write a ``kiln.toml`` here: the message says why and what to do."""


@dataclass(frozen=True)
class SuitePlan:
    name: str
    paths: tuple[str, ...]
    gpus: int = 0
    markers: str = ""
    requires: tuple[str, ...] = ()
    publish_untested: bool = False
    why: str = ""


@dataclass(frozen=True)
class Findings:
    root: Path
    kind: Kind
    package: str  # import name
    distribution: str
    version: str
    source: str  # the package directory, relative to the root
    requires_python: str
    registry: str | None  # "module:attribute" of a Kiln kernel registry
    runtime: bool  # the package imports kiln.runtime at run time (its loader)
    torch_extension: bool  # a torch C++/CUDA extension: builds against a CUDA torch, pins it
    cuda_build: bool  # the package compiles device code for CUDA (a GPU variant is worth building)
    suites: tuple[SuitePlan, ...]
    reasons: tuple[str, ...]  # what was inferred and why, one line each
    own_archs: bool = False  # its build hard-codes its own -gencode list: the wheel may hold more archs


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise OnboardingError(f"{path} is not valid TOML ({exc}); fix it, then run kiln init again") from None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def _setup_cfg(root: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(root / "setup.cfg", encoding="utf-8")
    except configparser.Error:
        pass  # an unreadable setup.cfg says nothing kiln init needs; the build reports it
    return parser


def _packages_in(base: Path) -> list[Path]:
    if not base.is_dir():
        return []
    return sorted(d for d in base.iterdir() if d.is_dir() and (d / "__init__.py").is_file()
                  and d.name.isidentifier() and d.name not in _SKIP_DIRS and not d.name.startswith("."))


def _find_package(root: Path, distribution: str | None) -> tuple[Path, str]:
    """The import package's directory and the reason: the src layout first, the distribution's name first."""
    for base, layout in ((root / "src", "src layout"), (root, "flat layout")):
        found = _packages_in(base)
        if not found:
            continue
        wanted = canonicalize_name(distribution).replace("-", "_") if distribution else ""
        match = [p for p in found if p.name.lower() == wanted]
        chosen = (match or found)[0]
        why = "named like the distribution" if match else (
            "the only package" if len(found) == 1 else f"the first of {[p.name for p in found]}")
        return chosen, f"{layout}: {chosen.relative_to(root).as_posix()}/ ({why})"
    raise OnboardingError(f"{root} holds no Python package: no src/<name>/__init__.py and no <name>/__init__.py;"
                          " run kiln init in the repository of a Python package")


def _py_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def _first_match(files: list[Path], pattern: re.Pattern[str]) -> Path | None:
    return next((f for f in files if pattern.search(_text(f))), None)


def _registry(package_dir: Path, package: str) -> str | None:
    registry = package_dir / "registry.py"
    text = _text(registry)
    if "kiln.runtime" in text and re.search(r"^def registry\(", text, re.M):
        return f"{package}.registry:registry"
    return None


def _metadata(root: Path, pyproject: dict[str, Any], setup_py: str) -> dict[str, str]:
    """Name, version and requires-python as the package declares them (pyproject, setup.cfg, setup.py)."""
    project = pyproject.get("project", {})
    cfg = _setup_cfg(root)
    found: dict[str, str] = {}
    for key, setup_key in (("name", "name"), ("version", "version"), ("requires-python", "python_requires")):
        value = project.get(key) or cfg.get("metadata", key, fallback=None) or cfg.get("options", setup_key,
                                                                                           fallback=None)
        match = re.search(_SETUP_FIELD.format(setup_key), setup_py) if not value else None
        value = value or (match.group(1) if match else None)
        if isinstance(value, str) and value and not value.startswith(("attr:", "file:")):
            found[key] = value
    return found


def _native(root: Path, pyproject: dict[str, Any], setup_py: str) -> tuple[bool, bool, str]:
    """(builds native code, is a torch extension, why)."""
    backend = str(pyproject.get("build-system", {}).get("build-backend", ""))
    if _TORCH_EXT.search(setup_py):
        return True, True, "setup.py builds a torch C++/CUDA extension (torch.utils.cpp_extension)"
    if _CMAKE_TORCH.search(_text(root / "CMakeLists.txt")):
        return True, True, "CMakeLists.txt builds against torch (find_package(Torch))"
    if any(backend.startswith(b) for b in _NATIVE_BACKENDS):
        return True, False, f"its build backend {backend!r} compiles native code"
    if (root / "CMakeLists.txt").is_file():
        return True, False, "a CMakeLists.txt builds native code"
    if _NATIVE_BUILD.search(setup_py):
        return True, False, "setup.py compiles native code (nvcc, Extension or CMake)"
    return False, False, ""


def _cuda_sources(root: Path) -> bool:
    return any(p.suffix in (".cu", ".cuh") for p in root.rglob("*.cu*")
               if not any(part.startswith(".") for part in p.relative_to(root).parts))


def _kind(root: Path, package_dir: Path, package: str, pyproject: dict[str, Any],
          setup_py: str) -> tuple[Kind, str | None, bool, bool, str]:
    """(kind, registry, torch extension, cuda build, why)."""
    registry = _registry(package_dir, package)
    if registry is not None:
        return "registry", registry, False, True, (f"kind registry: {registry} describes kernels with kiln.runtime;"
                                                   " Kiln compiles them ahead of time per arch")
    native, torch_ext, why = _native(root, pyproject, setup_py)
    has_build = bool(pyproject) or bool(setup_py)
    if native:
        return "pep517", None, torch_ext, _cuda_sources(root) or torch_ext, (
            f"kind pep517: {why}; its own backend builds one wheel per variant")
    files = _py_files(package_dir)
    triton = _first_match(files, _TRITON_KERNEL) or _first_match(files, _TRITON)
    if triton is not None and has_build:
        return "triton-jit", None, False, False, (
            f"kind triton-jit: {triton.relative_to(root).as_posix()} uses Triton and nothing compiles native code;"
            " one portable wheel, kernels compiled at run time")
    if not has_build:
        raise OnboardingError(f"{root} has no pyproject.toml or setup.py and no Kiln kernel registry"
                              f" ({package_dir.relative_to(root).as_posix()}/registry.py): nothing says how to build"
                              " it; add a pyproject.toml, then run kiln init again")
    return "pep517", None, False, False, "kind pep517: a pure-Python package built by its own backend (cpu variant)"


def _markers(root: Path, pyproject: dict[str, Any], tests: list[Path]) -> set[str]:
    declared: list[str] = list(pyproject.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("markers", []))
    for name, section in (("pytest.ini", "pytest"), ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(root / name, encoding="utf-8")
        except configparser.Error:
            continue
        declared += parser.get(section, "markers", fallback="").splitlines()
    names = {line.split(":")[0].split("(")[0].strip() for line in declared if line.strip()}
    for conftest in [root / "conftest.py", *(t for t in tests if t.name == "conftest.py")]:
        names |= set(_CONFTEST_MARKER.findall(_text(conftest)))
    return {n for n in names if n.isidentifier()}


def _tests_dir(root: Path, pyproject: dict[str, Any]) -> Path | None:
    paths = pyproject.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("testpaths", [])
    for candidate in [*paths, "tests", "test"]:
        path = root / str(candidate)
        if path.is_dir() and path.resolve().is_relative_to(root.resolve()):
            return path
    return None


def _suites(root: Path, pyproject: dict[str, Any], kind: Kind) -> tuple[tuple[SuitePlan, ...], str]:
    tests = _tests_dir(root, pyproject)
    if tests is None:
        return (), "no tests folder (tests/, test/ or [tool.pytest.ini_options] testpaths): no suite"
    rel = tests.relative_to(root).as_posix()
    files = _py_files(tests)
    markers = _markers(root, pyproject, files)
    gpu_markers = sorted(m for m in _GPU_MARKERS if m in markers)
    interpreter = ("Triton's interpreter",) if kind == "triton-jit" else ()
    requires = ("numpy",) if interpreter else ()
    cpu_filter = ["not slow"] if "slow" in markers else []
    if gpu_markers:
        cpu = " and ".join([*(f"not {m}" for m in gpu_markers), *cpu_filter])
        gpu = " or ".join(gpu_markers)
        return (SuitePlan("unit", (rel,), 0, cpu, requires, why=f"{rel}/ without the GPU markers {gpu_markers}"),
                SuitePlan("gpu", (rel,), 1, gpu, (), True, why=f"{rel}/ marked {gpu}")), (
            f"suites from {rel}/ ({len(files)} files): its markers {gpu_markers} split CPU and GPU tests")
    cpu_ready = _first_match(files, _CPU_READY)
    uses_gpu = _first_match(files, _GPU_USE) if cpu_ready is None else None
    if uses_gpu is not None:
        where = uses_gpu.relative_to(root).as_posix()
        return (SuitePlan("gpu", (rel,), 1, " and ".join(cpu_filter), (), True,
                          why=f"{where} puts tensors on a CUDA device"),), (
            f"suite gpu from {rel}/ ({len(files)} files): {where} uses a CUDA device, so it runs on a GPU pool"
            " (not run on a machine without one; the wheel is then published marked untested)")
    how = " through Triton's interpreter" if interpreter or cpu_ready else ""
    if cpu_ready is not None:
        how += f" ({cpu_ready.relative_to(root).as_posix()} sets TRITON_INTERPRET where no GPU is)"
    return (SuitePlan("unit", (rel,), 0, " and ".join(cpu_filter), requires, why=f"{rel}/ runs on the CPU"),), (
        f"suite unit from {rel}/ ({len(files)} files): it runs on the CPU{how}")


def inspect_project(root: Path) -> Findings:
    """What ``root`` (a package's repository) says about how to build and test it; raise :class:`OnboardingError`."""
    root = root.resolve()
    if not root.is_dir():
        raise OnboardingError(f"{root} is not a directory; run kiln init in (or on) a package's repository")
    pyproject = _read_toml(root / "pyproject.toml")
    setup_py = _text(root / "setup.py")
    meta = _metadata(root, pyproject, setup_py)
    package_dir, layout = _find_package(root, meta.get("name"))
    package = package_dir.name
    kind, registry, torch_ext, cuda_build, kind_why = _kind(root, package_dir, package, pyproject, setup_py)
    if kind != "registry" and not (root / "pyproject.toml").is_file():
        raise OnboardingError(f"{root} has a setup.py but no pyproject.toml, which Kiln's pep517 build reads;"
                              " add one with a [build-system] table (e.g. requires = [\"setuptools\"]), then run"
                              " kiln init again")
    version, version_why = _version(meta.get("version") or _version_in(package_dir))
    reasons = [layout, kind_why, *version_why]
    if "name" not in meta:
        reasons.append(f"distribution {package!r}: the package declares no name, so its import name")
    suites, suites_why = _suites(root, pyproject, kind)
    own = next((name for name in ("setup.py", "CMakeLists.txt") if kind == "pep517" and cuda_build
                and _OWN_ARCHS.search(_text(root / name))), None)
    if own:
        reasons.append(f"arch_policy at_least: {own} names its own CUDA archs, so its wheel may hold more than the"
                       " variant's (each one is recorded)")
    reasons.append(suites_why)
    runtime = any("kiln.runtime" in _text(f) for f in _py_files(package_dir) if f.name != "registry.py")
    return Findings(root, kind, package, meta.get("name", package), version,
                    package_dir.relative_to(root).as_posix(), meta.get("requires-python", ">=3.10"), registry,
                    runtime, torch_ext, cuda_build, suites, tuple(reasons), own_archs=own is not None)


def _version(declared: str | None) -> tuple[str, list[str]]:
    """The nightly base version, and why when it is not the one the package declares."""
    version = _next_version(declared)
    if version is None:
        return "0.1.0", [f"version 0.1.0: the package declares no static PEP 440 version ({declared or 'none'});"
                         " set [project] version"]
    if version != declared:
        return version, [f"version {version}: the package declares {declared}; its nightlies ({version}.dev<time>)"
                         " sort above that release, as setuptools-scm's next versions do"]
    return version, []


def _next_version(declared: str | None) -> str | None:
    """The nightly base: after a final release ``1.2.3`` -> ``1.2.4``; a pre- or post-release stays, a
    ``.devN`` or ``+local`` part goes (the nightly adds its own); None when it is no PEP 440 version."""
    try:
        parsed = Version(declared or "")
    except InvalidVersion:
        return None
    if parsed.dev is not None or parsed.local:
        return str(parsed.public).split(".dev")[0]
    if parsed.is_prerelease or parsed.is_postrelease:
        return str(parsed)
    release = list(parsed.release) + [0] * (3 - len(parsed.release))
    release[-1] += 1
    prefix = f"{parsed.epoch}!" if parsed.epoch else ""
    return prefix + ".".join(map(str, release))


def _version_in(package_dir: Path) -> str | None:
    match = _DUNDER_VERSION.search(_text(package_dir / "__init__.py"))
    return match.group(1) if match else None
