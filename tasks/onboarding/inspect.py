"""What a package's repository says about how it builds and tests (pure: reads files, writes nothing).

:func:`inspect_project` looks at what is there — ``pyproject.toml`` or
``setup.py``, a src or flat layout, a ``CUDAExtension``/CMake/nvcc build, a
Kiln kernel registry, Triton imports, a tests folder, pytest markers — and
returns :class:`Findings`: each choice ``kiln init`` makes, with the reason it
was made (:mod:`kiln.tasks.onboarding.render` writes them as ``kiln.toml``).
"""

from __future__ import annotations

import configparser
import fnmatch
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.core.errors import ConfigError
from kiln.tasks.onboarding.names import (
    Declared,
    declarations,
    declared_packages,
    package_bases,
    parse_setup_py,
)
from kiln.tasks.onboarding.native import native_build, native_code
from kiln.tasks.onboarding.sources import missing_sources

# registry: Kiln compiles the Triton kernels a kiln.runtime registry names (Kiln's own wheel builder);
# pep517: the package builds itself (setuptools, CMake, a torch C++/CUDA extension), one wheel per variant;
# triton-jit: a pure-Triton package, one portable wheel whose kernels compile at run time.
Kind = Literal["registry", "pep517", "triton-jit"]
KINDS: tuple[str, ...] = get_args(Kind)

_SKIP_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "benchmark", "benchmarks", "build", "dist",
              "scripts", "tools", "dev", "src", "csrc", "site-packages", "node_modules", "third_party", "include"}
_TRITON_KERNEL = re.compile(r"^\s*@triton\.(jit|autotune)\b", re.M)
_TRITON = re.compile(r"^\s*(import triton\b|from triton(\.| )\S*\s*import\b)", re.M)
# Tests written to run on the CPU too: they put Triton in interpreter mode where no GPU is.
_CPU_READY = re.compile(r"\bTRITON_INTERPRET\b")
_GPU_USE = re.compile(r"""["']cuda(:\d+)?["']|\.cuda\(|torch\.cuda\.|device\s*=\s*["']cuda""")
# A literal compute capability in a -gencode flag: the build picks its own archs, whatever Kiln exports.
_OWN_ARCHS = re.compile(r"arch=compute_\d+|-arch=sm_\d+|CUDA_ARCHITECTURES\s+\"?\d")
DEFAULT_REQUIRES_PYTHON = ">=3.10"  # where a package declares none: said, never silent
_GPU_MARKERS = ("gpu", "cuda", "multi_gpu", "distributed")
_CONFTEST_MARKER = re.compile(r"""addinivalue_line\(\s*["']markers["']\s*,\s*["']([A-Za-z_][A-Za-z0-9_]*)""")
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
    # exact: the build compiles the archs Kiln exports; narrow: setup.py hard-codes its own -gencode list, which
    # Kiln's nvcc narrows to the variant's; at_least: CMake names its own archs, the wheel may hold more
    arch_policy: str = "exact"
    cpu_build: bool = True  # the build has a CPU path (a cpu variant is worth building)
    gpu_env: tuple[tuple[str, str], ...] = ()  # the build_env its GPU variants need (build switches)
    setup_py_only: bool = False  # no pyproject.toml: PEP 517's fallback, setuptools' legacy backend, builds it
    # What kiln init could not decide: (field, the other candidates) for "package" or "distribution"; the file
    # holds the first candidate, the others as a commented choice, and the command says so on stderr
    undecided: tuple[tuple[str, tuple[str, ...]], ...] = ()
    cpu_env: tuple[tuple[str, str], ...] = ()  # the build_env its CPU variant needs (the switch opening its CPU path)
    also_read: tuple[str, ...] = ()  # the other variables its build reads, "NAME (what it controls, where)"
    # What kiln init had to assume where the package says nothing: said in the header and on stderr
    assumed: tuple[str, ...] = ()
    missing_sources: tuple[str, ...] = ()  # native sources its build names and the tree lacks: every build fails


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


def _is_dir_name(d: Path) -> bool:
    return d.is_dir() and d.name.isidentifier() and d.name not in _SKIP_DIRS and not d.name.startswith(".")


def _packages_in(base: Path) -> list[tuple[Path, str]]:
    """The import packages under ``base``: (folder, dotted name). A regular package has an ``__init__.py``; a
    PEP 420 namespace folder has none, and the packages inside it are ``org.pkg`` (two levels deep at most)."""
    if not base.is_dir():
        return []
    found: list[tuple[Path, str]] = []
    namespaces = [(d, d.name) for d in sorted(base.iterdir()) if _is_dir_name(d)]
    for depth in range(3):
        deeper: list[tuple[Path, str]] = []
        for folder, dotted in namespaces:
            if (folder / "__init__.py").is_file():
                found.append((folder, dotted))
            elif depth < 2:
                deeper += [(d, f"{dotted}.{d.name}") for d in sorted(folder.iterdir()) if _is_dir_name(d)]
        namespaces = deeper
    return found


def _named(dotted: str, patterns: tuple[str, ...]) -> bool:
    """Whether the build config's ``packages``/``include`` entries name the package ``dotted``."""
    return any(fnmatch.fnmatchcase(dotted, p) or p == dotted or p.startswith(f"{dotted}.")
               or ("." not in dotted and p.split(".")[0] == dotted) for p in patterns)


def _listing(root: Path) -> str:
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir() if not p.name.startswith("."))
    return ", ".join(entries[:12]) + (f" and {len(entries) - 12} more" if len(entries) > 12 else "") or "nothing"


def _find_package(root: Path, distribution: str | None, pyproject: dict[str, Any],
                  setup_py: str) -> tuple[Path, str, str, tuple[str, ...]]:
    """The import package's directory, its dotted name, the reason and the other candidates when it could not
    decide: where the build config says, then the src layout, then the flat one; among the packages there
    (regular or PEP 420 namespace ones; those the build config names, if it names any), the one named like the
    distribution, else the only one (whatever its name)."""
    patterns = declared_packages(root, pyproject, setup_py)
    bases = package_bases(root, pyproject, setup_py)
    for base, layout in bases:
        found = _packages_in(base)
        if not found:
            continue
        wanted = canonicalize_name(distribution).replace("-", "_") if distribution else ""
        listed = [p for p in found if _named(p[1], patterns)]
        regular = [p for p in found if "." not in p[1]]
        candidates = listed or regular or found
        named = [p for p in candidates if p[1].lower().replace(".", "_") == wanted]
        chosen = (named or candidates)[0]
        others = tuple(p[1] for p in candidates if p != chosen) if not named else ()
        why = "named like the distribution" if named else (
            f"could not decide between {[p[1] for p in candidates]}: the first is written, the others as a"
            " commented choice" if others else
            "the package its build config lists" if listed else "the only package")
        if "." in chosen[1]:
            why += f"; a PEP 420 namespace package: {chosen[1].rsplit('.', 1)[0].replace('.', '/')}/ has no __init__.py"
        return chosen[0], chosen[1], f"{layout}: {chosen[0].relative_to(root).as_posix()}/ ({why})", others
    where = "; ".join(f"{b.relative_to(root).as_posix() or '.'}/ ({why})" for b, why in dict(bases).items())
    names = f"; its build config names {list(patterns)}" if patterns else ""
    raise OnboardingError(f"{root} holds no Python package: kiln init looked for <name>/__init__.py (a package) and"
                          f" <namespace>/<name>/__init__.py (a PEP 420 namespace package) in {where}{names}, and"
                          f" found none; the top level holds {_listing(root)}; run kiln init in the repository of a"
                          " Python package")


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


@dataclass(frozen=True)
class _Build:
    kind: Kind
    why: str
    registry: str | None = None
    torch_extension: bool = False
    cuda_build: bool = False
    cpu_build: bool = True
    gpu_env: tuple[tuple[str, str], ...] = ()
    switches_why: tuple[str, ...] = ()
    cpu_env: tuple[tuple[str, str], ...] = ()
    also_read: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()



def _native_build(root: Path, pyproject: dict[str, Any], setup_py: str, why: str, torch_ext: bool) -> _Build:
    n = native_build(root, pyproject, setup_py, why, torch_ext)
    return _Build("pep517", f"kind pep517: {n.why}; its own backend builds one wheel per variant", None,
                  n.torch_extension, n.cuda_build, n.cpu_build, n.gpu_env, n.reasons, n.cpu_env, n.also_read,
                  n.assumed)


def _kind(root: Path, package_dir: Path, package: str, pyproject: dict[str, Any], setup_py: str) -> _Build:
    registry = _registry(package_dir, package)
    if registry is not None:
        return _Build("registry", f"kind registry: {registry} describes kernels with kiln.runtime; Kiln compiles"
                      " them ahead of time per arch", registry, cuda_build=True)
    native, torch_ext, why = native_code(root, pyproject, setup_py)
    has_build = bool(pyproject) or bool(setup_py)
    if native:
        return _native_build(root, pyproject, setup_py, why, torch_ext)
    files = _py_files(package_dir)
    triton = _first_match(files, _TRITON_KERNEL) or _first_match(files, _TRITON)
    if triton is not None and has_build:
        return _Build("triton-jit", f"kind triton-jit: {triton.relative_to(root).as_posix()} uses Triton and nothing"
                      " compiles native code; one portable wheel, kernels compiled at run time")
    if not has_build:
        raise OnboardingError(f"{root} has no pyproject.toml or setup.py and no Kiln kernel registry"
                              f" ({package_dir.relative_to(root).as_posix()}/registry.py): nothing says how to build"
                              " it; add a pyproject.toml, then run kiln init again")
    return _Build("pep517", "kind pep517: a pure-Python package built by its own backend (cpu variant)")


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


def _gpu_only(suites: tuple[SuitePlan, ...]) -> tuple[SuitePlan, ...]:
    """A package without a CPU build: its CPU suites can only run against a GPU wheel, on a GPU pool."""
    return tuple(s if s.gpus else replace(s, gpus=1, publish_untested=True, why=f"{s.why}; no CPU build, so on a"
                                          " GPU") for s in suites)


def _distribution(names: list[Declared], package: str) -> tuple[str, str, tuple[str, ...]]:
    """The distribution's name, why, and the other names the package declares where they disagree."""
    if not names:
        return package, f"distribution {package!r}: the package declares no name, so its import name", ()
    first = names[0]
    others = tuple(dict.fromkeys(n.value for n in names[1:]
                                 if canonicalize_name(n.value) != canonicalize_name(first.value)))
    if others:
        where = "; ".join(f"{n.value!r} in {n.where}" for n in names)
        return first.value, (f"distribution {first.value!r}: could not decide, the package declares {where}: the"
                             " first is written, the others as a commented choice"), others
    return first.value, f"distribution {first.value!r}: {first.where}", ()


def inspect_project(root: Path) -> Findings:
    """What ``root`` (a package's repository) says about how to build and test it; raise :class:`OnboardingError`."""
    root = root.resolve()
    if not root.is_dir():
        raise OnboardingError(f"{root} is not a directory; run kiln init in (or on) a package's repository")
    pyproject = _read_toml(root / "pyproject.toml")
    setup_py = _text(root / "setup.py")
    declared = declarations(root, pyproject, setup_py)
    meta = {key: found[0] for key, found in declared.items() if found}
    name = meta["name"].value if "name" in meta else None
    package_dir, package, layout, other_packages = _find_package(root, name, pyproject, setup_py)
    build = _kind(root, package_dir, package, pyproject, setup_py)
    version, version_why = _version(meta["version"].value if "version" in meta else _version_in(package_dir))
    distribution, distribution_why, other_names = _distribution(declared["name"], package)
    undecided = tuple((field, others) for field, others in (("distribution", other_names),
                                                            ("package", other_packages)) if others)
    reasons = [distribution_why, layout, build.why, *build.switches_why, *version_why]
    suites, suites_why = _suites(root, pyproject, build.kind)
    if build.kind == "pep517" and build.cuda_build and not build.cpu_build:
        suites = _gpu_only(suites)
    own = next((name for name in ("setup.py", "CMakeLists.txt") if build.kind == "pep517" and build.cuda_build
                and _OWN_ARCHS.search(_text(root / name))), None)
    policy = "narrow" if own == "setup.py" else "at_least" if own else "exact"
    if policy == "narrow":
        reasons.append("arch_policy narrow: setup.py names its own CUDA archs (-gencode), so its build compiles"
                       " through Kiln's nvcc, which keeps the variant's archs of that list and drops the rest")
    elif own:
        reasons.append(f"arch_policy at_least: {own} names its own CUDA archs, so its wheel may hold more than the"
                       " variant's (each one is recorded)")
    reasons.append(suites_why)
    runtime = any("kiln.runtime" in _text(f) for f in _py_files(package_dir) if f.name != "registry.py")
    assumed = list(build.assumed)
    if "requires-python" in meta:
        requires_python = meta["requires-python"].value
    else:
        requires_python = DEFAULT_REQUIRES_PYTHON
        assumed.insert(0, f"requires_python {requires_python!r}: the package declares none (no [project]"
                          " requires-python, python_requires or Requires-Python); set the Pythons it supports")
    return Findings(root, build.kind, package, distribution, version, package_dir.relative_to(root).as_posix(),
                    requires_python, build.registry, runtime, build.torch_extension, build.cuda_build, suites,
                    tuple(reasons), arch_policy=policy, cpu_build=build.cpu_build, gpu_env=build.gpu_env,
                    setup_py_only=not (root / "pyproject.toml").is_file() and bool(setup_py), undecided=undecided,
                    cpu_env=build.cpu_env, also_read=build.also_read, assumed=tuple(assumed),
                    missing_sources=missing_sources(root, parse_setup_py(setup_py), pyproject) if build.kind == "pep517"
                    else ())


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
    """The nightly base: after a final or post-release ``1.2.3(.post1)`` -> ``1.2.4`` (``1.2.3.post1.devN`` would
    sort below the post-release); a pre-release stays, a ``.devN`` or ``+local`` part goes (the nightly adds its
    own); None when it is no PEP 440 version."""
    try:
        parsed = Version(declared or "")
    except InvalidVersion:
        return None
    if parsed.dev is not None or parsed.local:
        return str(parsed.public).split(".dev")[0]
    if parsed.pre is not None:
        return str(parsed)
    release = list(parsed.release) + [0] * (3 - len(parsed.release))
    release[-1] += 1
    prefix = f"{parsed.epoch}!" if parsed.epoch else ""
    return prefix + ".".join(map(str, release))


def _version_in(package_dir: Path) -> str | None:
    match = _DUNDER_VERSION.search(_text(package_dir / "__init__.py"))
    return match.group(1) if match else None
