"""``[build] backend = "pep517"``: the project's own build backend builds each variant's wheel.

One unit per variant (see :func:`kiln.tasks.build.plan.plan_variant`). The
unit builds from a private copy of the project as its own build would see it
(:func:`kiln.tasks.build.sources.copy_project`: in git, a clone at HEAD with
the working tree's changes laid over it, ``.git`` included, so setuptools-scm
reads its file list and version; never Kiln's ``.kiln/``, ``--out`` or build
cache), so no variant reuses another's objects, and runs ``pip wheel
--no-deps --no-build-isolation`` there in a fresh virtual environment made for
the unit. That environment sees, after its own packages, the variant's build
environment (``build_requires``, :mod:`kiln.tasks.build.buildenv`: e.g. a
CUDA build of torch) or, for a variant without one, Kiln's interpreter's
packages: the torch a cpp_extension build compiles against, which an
isolated build could not fetch offline; build requirements it lacks are
installed into it. The variant's filtered arch list is exported in the forms
the ecosystem reads, the toolchain settings through the compilers' own
variables (:func:`build_environ`), the variant's ``build_env`` as it is; no
download host is reachable from the build (:func:`~kiln.tasks.build.guest_install.without_network`). The
wheel then goes through :func:`kiln.tasks.wheel.devicecode.check_wheel` under
the variant's ``arch_policy``; the archs it holds travel with the wheel as
:data:`DEVICE_CODE`, so the build results record them on a hit too.

The copy, its build directories and the unit's environment live in a
directory named by the unit's cache key (:func:`kiln.tasks.build.stagedir.fixed_dir`),
and the build gets path maps, ``SOURCE_DATE_EPOCH`` (the commit time) and
``PYTHONHASHSEED`` (:mod:`kiln.tasks.build.reproducible`): the same commit
gives the same wheel in any clone, on any worker (invariant 8). Every compiler the build runs goes
through the build's compile cache (:mod:`kiln.tasks.build.compiler_shims`), whose statistics (translation
units compiled and reused) become the unit's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import canonicalize_name, parse_wheel_filename

from kiln.core import venvs
from kiln.core.errors import CompileError
from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.build import stagedir
from kiln.tasks.build.buildenv import BuildEnvironment, VariantEnvironments, overlay_env
from kiln.tasks.build.compile_cache import COMPILE_STATS, CompileCache
from kiln.tasks.build.compiler_shims import ACTIVE, cached_compilers, unit_stats
from kiln.tasks.build.cross import (
    CrossTarget,
    checked_wheel,
    cross_target_of,
    default_cache_dir,
    manylinux_tagged,
    unit_environ,
)
from kiln.tasks.build.cross_torch import staged_torch, torch_environ
from kiln.tasks.build.cuda_toolkits import cell_cuda_home, toolkit_environ
from kiln.tasks.build.guest_install import install_build_requirements, without_network
from kiln.tasks.build.nvcc_narrow import narrowed, narrowed_cuda_home
from kiln.tasks.build.reproducible import commit_time, path_maps, reproducible_environ
from kiln.tasks.build.sources import copy_project
from kiln.tasks.process import run_tool
from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.config_build import Toolchain
from kiln.tasks.project.config_project import pinned_version
from kiln.tasks.wheel.compiled_here import BUILD_DIR, build_dir_options, foreign_out_of_tree, out_of_tree
from kiln.tasks.wheel.devicecode import check_wheel, held
from kiln.tasks.wheel.stable_abi import build_target, stable_environ, target_hex

if TYPE_CHECKING:
    from kiln.tasks.build.plan import CompileUnit

_log = logging.getLogger(__name__)
_TAIL_CHARS = 4000
# Inherited variables that choose archs or flags: the variant's values replace them, never mix with them.
_OWNED = ("TORCH_CUDA_ARCH_LIST", "CMAKE_CUDA_ARCHITECTURES", "CUDAARCHS", "PYTORCH_ROCM_ARCH", "HIPARCHS",
          "NVCC_APPEND_FLAGS", "HIPCC_COMPILE_FLAGS_APPEND", "KILN_VARIANT", "KILN_BACKEND")
DEFAULT_BUILD_REQUIRES = ("setuptools>=40.8.0",)  # PEP 518's default for a pyproject.toml without [build-system]
DEVICE_CODE = "kiln-device-code.json"  # beside a pep517 unit's wheel: the archs it holds (not part of the wheel)
# What a cpu variant's build does not see: a setup.py that builds its CUDA extension wherever it finds nvcc (or a
# CUDA_HOME) builds its CPU extension only.
_CUDA_TOOLS = ("nvcc",)
_CUDA_VARS = ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CUDACXX")
# A compiled library in a wheel (a shared object, a Python extension on any platform).
_BINARY = re.compile(r"\.(so(\.[0-9]+)*|pyd|dylib)$")
NARROWED_HOME = "cuda-narrow"  # under a unit's tool directory: the CUDA home whose nvcc narrows (arch_policy narrow)


def cmake_arch(name: str) -> str:
    """``"8.0"`` -> ``"80-real"`` (SASS only), ``"12.0+PTX"`` -> ``"120"`` (SASS and PTX), CMake's spelling."""
    arch = parse_cuda_arch(name)
    number = arch.sm.removeprefix("sm_")
    return number if arch.ptx else f"{number}-real"


def build_environ(backend: str, variant: str, archs: Sequence[str], toolchain: Toolchain, jobs: int,
                  cuda_home: str | None, base: Mapping[str, str]) -> dict[str, str]:
    """The backend's environment: ``base`` with the variant's archs and the toolchain settings in it."""
    env = {k: v for k, v in base.items() if k not in _OWNED}
    env |= {"KILN_VARIANT": variant, "KILN_BACKEND": backend, "MAX_JOBS": str(jobs),
            "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    if backend == "cuda":
        cmake = ";".join(cmake_arch(a) for a in archs)
        env |= {"TORCH_CUDA_ARCH_LIST": ";".join(archs), "CMAKE_CUDA_ARCHITECTURES": cmake, "CUDAARCHS": cmake}
        if cuda_home and not env.get("CUDA_HOME"):
            env["CUDA_HOME"] = cuda_home
    elif backend == "hip":
        # HIP_PLATFORM: hipcc on a machine that also has nvcc would compile for NVIDIA
        env |= {"PYTORCH_ROCM_ARCH": ";".join(archs), "HIPARCHS": ";".join(archs), "HIP_PLATFORM": "amd"}
    common = [*(f"-I{d}" for d in toolchain.include_dirs), *(f"-D{d}" for d in toolchain.defines)]
    if common or toolchain.nvcc_flags:
        env["NVCC_APPEND_FLAGS"] = shlex.join([*common, *toolchain.nvcc_flags])
    if common or toolchain.hipcc_flags:
        env["HIPCC_COMPILE_FLAGS_APPEND"] = shlex.join([*common, *toolchain.hipcc_flags])
    links = [*(f"-L{d}" for d in toolchain.library_dirs), *(f"-l{lib}" for lib in toolchain.libraries)]
    if links:
        env["LDFLAGS"] = " ".join(filter(None, [base.get("LDFLAGS", ""), shlex.join(links)]))
    return env


def hide_cuda_toolkit(environ: Mapping[str, str], shadow: Path) -> dict[str, str]:
    """``environ`` without a CUDA toolkit, for a cpu variant's build: no ``CUDA_HOME``-like variable, and each
    ``PATH`` directory that holds ``nvcc`` replaced by a mirror of it under ``shadow`` (links to all but nvcc)."""
    env = {k: v for k, v in environ.items() if k not in _CUDA_VARS}
    entries = env.get("PATH", "").split(os.pathsep)
    for index, entry in enumerate(entries):
        directory = Path(entry)
        if not entry or not any(os.access(directory / tool, os.X_OK) for tool in _CUDA_TOOLS):
            continue
        mirror = shadow / str(index)
        mirror.mkdir(parents=True, exist_ok=True)
        for item in directory.iterdir():
            if item.name not in _CUDA_TOOLS and not (mirror / item.name).is_symlink():
                (mirror / item.name).symlink_to(item)
        entries[index] = str(mirror)
    if "PATH" in env:
        env["PATH"] = os.pathsep.join(entries)
    return env


def _setuptools(project_dir: Path) -> bool:
    """Whether setuptools builds the project (its backend, or no pyproject.toml: the legacy fallback)."""
    pyproject = project_dir / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text()) if pyproject.is_file() else {}
    return str(data.get("build-system", {}).get("build-backend", "setuptools")).startswith("setuptools")


def _digests(root: Path, skip: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")
            if p.is_file() and _BINARY.search(p.name) and not p.is_relative_to(skip) and ".git" not in p.parts}


def foreign_binaries(wheel: Path, source: Path, dist: Path) -> list[str]:
    """The compiled libraries of ``wheel`` that a setuptools build of ``source`` did not leave in its tree.

    setuptools compiles into, or copies package data through, ``build/`` of the project it builds; a library
    found nowhere in that tree came from elsewhere (a ``bdist_wheel`` that fetched a prebuilt wheel)."""
    with zipfile.ZipFile(wheel) as archive:
        members = {n: hashlib.sha256(archive.read(n)).hexdigest() for n in archive.namelist() if _BINARY.search(n)}
    if not members:
        return []
    here = _digests(source, dist)
    return sorted(n for n, digest in members.items() if digest not in here)


def cuda_home(nvcc: str) -> str | None:
    """The toolkit root of ``nvcc`` as nvcc itself reports it (``TOP`` of a dry run: wrappers resolve too)."""
    with tempfile.TemporaryDirectory(prefix="kiln-nvcc-top-") as tmp:
        (Path(tmp) / "empty.cu").write_text("")
        result = run_tool([nvcc, "-dryrun", "-c", "empty.cu", "-o", "empty.o"], 30, cwd=Path(tmp))  # runs nothing
    for line in result.stdout.splitlines():
        if line.startswith("#$ TOP="):
            return str(Path(line.split("=", 1)[1].strip()).resolve())
    return None


def build_requires(project_dir: Path) -> list[str]:
    pyproject = project_dir / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text()) if pyproject.is_file() else {}
    return list(data.get("build-system", {}).get("requires", DEFAULT_BUILD_REQUIRES))


def _tail(text: str) -> str:
    return text[-_TAIL_CHARS:].strip()


@dataclass(frozen=True)
class ProjectBuilder:
    """The build stage's PEP 517 backend: builds one ``pep517`` unit (a variant's whole wheel)."""

    project_dir: Path
    distribution: str
    toolchain: Toolchain
    timeout_s: float
    jobs: int
    cuda_home: str | None = None
    cuobjdump: str | None = None
    exclude: tuple[Path, ...] = ()  # Kiln's state inside the project (the build cache): never copied
    variant_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # variant -> its build_env
    # abi = "stable" variants -> their torch_target (None: the torch they build against): the build is told it
    stable: Mapping[str, str | None] = field(default_factory=dict)
    pass_env: tuple[str, ...] = ()  # variables of Kiln's environment the build may see, by name
    writable: tuple[str, ...] = ()  # folders beyond the unit's own that the sandboxed build may write
    # (project dir, variant, backend, its build_env, what the build printed) -> the settings to change; handed in
    # by the flow (kiln init's switch reading lives above the build layer)
    advise: Callable[[Path, str, str, Mapping[str, str], str], list[str]] | None = None
    # the per-translation-unit compile cache every compiler of the build goes through (compiler_shims)
    compile_cache: CompileCache | None = None

    # Any: a CompileContext: kiln.tasks.build.units imports this module, so naming it here is a cycle
    def build_unit(self, unit: CompileUnit, env: Any) -> dict[str, bytes]:
        """Build the variant's wheel, check its device code; ``{wheel filename: bytes, DEVICE_CODE: json}``."""
        what = f"{self.distribution} (variant {unit.variant}, {unit.backend} {list(unit.archs) or 'no archs'})"
        if unit.backend == "cuda" and self.cuobjdump is None:
            raise CompileError(f"{what}: cuobjdump not found (Triton's package or PATH), so the wheel's device code"
                               " cannot be checked; install Triton or the CUDA toolkit")
        environments = getattr(env, "environments", None)
        made = environments.for_variant(unit.variant) if environments is not None else None  # the preflight too
        cross = _cross_target(env, unit.variant)  # an aarch64 cell on this x86_64 builder (kiln.tasks.build.cross)
        reads: list[Path] = []
        with stagedir.fixed_dir("pep517", unit.key[:16], self.timeout_s) as tmp:
            source = copy_project(self.project_dir, tmp / "src", self.exclude)
            dist = tmp / "dist"
            python = self._environment(tmp / "env", source, what, made)
            maps = path_maps(source, tmp, made.root if made is not None else None)
            environ = reproducible_environ(self.environ(unit, made, tmp / "path"), maps,
                                           commit_time(self.project_dir))
            # the scripts its build requirements installed (meson, cmake, ninja from the index) first, as pip's
            # own isolated builds have them
            environ["PATH"] = os.pathsep.join(filter(None, [str(python.parent), environ.get("PATH", "")]))
            if unit.variant in self.stable:
                target = build_target(self.stable[unit.variant], _build_torch(environments, unit.variant, what))
                _log.info("%s targets the torch %s stable ABI (TORCH_TARGET_VERSION=%s)", what, target,
                          target_hex(target))
                environ = stable_environ(environ, target)
            if cross is not None:
                _log.info("%s is cross-built for %s with %s", what, cross.platform, cross.tool("gcc"))
                environ, reads = unit_environ(cross, environ, tmp / "cross")
                if torch := _cross_torch(env, unit.variant):  # a torch extension: the target's torch, staged
                    staged = staged_torch(cross, torch, default_cache_dir())
                    environ, reads = torch_environ(staged, environ), [*reads, staged]
            if unit.backend == "cuda" and (home := _cell_cuda_home(env, unit.variant)) is not None:
                _log.info("%s compiles with the CUDA toolkit at %s (its cell's release)", what, home)
                environ, reads = toolkit_environ(home, environ), [*reads, home]
            stats_log = tmp / "compile-cache.log"
            # the compile cache's shims stand for the host's compilers; a cross build calls the target's by name
            if self.compile_cache is not None and cross is None:
                # base directory: the unit's folder, whose path changes with its key (a Python-only change, a
                # one-file change) and holds the sources, the environment and the build tree
                environ = cached_compilers(self.compile_cache, environ, tmp, tmp / "path" / "ccache", stats_log,
                                           nvcc=unit.arch_policy != "narrow", cuobjdump=self.cuobjdump)
            _log.info("building %s with its own backend", what)
            # -P: pip itself never imports a module of the project's root (its backend still reads setup.py there).
            safe = made.safe_path if made is not None else "-P"  # a Python 3.10 cell's: -I (no -P before 3.11)
            tree_env, tree_args, tree = build_dir_options(source, tmp / BUILD_DIR, environ)  # CMake, meson
            # the package's backend and build requirements run sandboxed: they write only this unit's folder
            # (sources, environment, build tree, dist) and see the allow-listed environment; no network at all
            cmd = [str(python), safe, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                   str(dist), *tree_args, str(source)]
            result = run_tool(guest_command(cmd, read=[tmp, *self.toolchain.include_dirs, *self.toolchain.library_dirs,
                                                      *self._launcher_dir(), *reads],
                                            write=[tmp, *self.writable, *self._cache_dirs()], network="none"),
                              self.timeout_s, cwd=source,
                              env=guest_environ(tmp / "home", tree_env, self.pass_env, base=environ))
            shimmed = narrowed(tmp / "path" / NARROWED_HOME)
            refused = next((n["refused"] for n in shimmed if "refused" in n), None)
            if result.returncode != 0 and refused:
                raise CompileError(f"the build of {what} under arch_policy \"narrow\" failed: {refused}")
            if result.returncode != 0:
                advice = self._what_to_set(unit, result.stdout)
                tail = _tail(result.stdout)
                raise CompileError(f"the build backend failed for {what} (exit {result.returncode})"
                                   + (f"; {'; '.join(advice)}" if advice else "")
                                   + (f"; its log ends:\n{tail}" if tail else "; it printed nothing"))
            wheel = self._one_wheel(dist, what)
            self._built_here(wheel, source, dist, what, tree)
            if cross is not None:  # tagged here, where the target is known: the wheel stage keeps a manylinux tag
                config = env.config  # _cross_target found the cell in it
                wheel = manylinux_tagged(checked_wheel(wheel, cross), tmp / "tagged", cross, unit.backend,
                                         config.build.manylinux, self.timeout_s)
            dropped = sorted({c for n in shimmed for c in n.get("dropped", ())})
            if dropped:
                _log.info("%s: Kiln's nvcc dropped the targets %s that its build names (arch_policy narrow)", what,
                          dropped)
            try:
                found = check_wheel(wheel, unit.backend, unit.archs, self.cuobjdump, policy=unit.arch_policy,
                                    variant=unit.variant)
            except CompileError as exc:  # a wheel without its library: often a switch its build did not get
                advice = self._what_to_set(unit, str(exc))
                if not advice:
                    raise
                raise CompileError(f"{exc}; {'; '.join(advice)}") from exc
            built = {wheel.name: wheel.read_bytes(), DEVICE_CODE: device_code_json(found, unit.arch_policy, dropped)}
            if self.compile_cache is not None:
                built[COMPILE_STATS] = json.dumps(unit_stats(stats_log, source).as_dict()).encode()
            return built

    def _launcher_dir(self) -> list[Path]:
        return self.compile_cache.read_paths() if self.compile_cache is not None else []  # and a read-only shared tier

    def _cache_dirs(self) -> list[Path]:
        """The compile cache's folders (its own, its writable shared tier): what a build writes outside its unit's."""
        return self.compile_cache.write_paths() if self.compile_cache is not None else []

    def _what_to_set(self, unit: CompileUnit, log: str) -> list[str]:
        """The settings the package's own build files say this failed unit lacks (read, never run)."""
        if self.advise is None:
            return []
        return self.advise(self.project_dir, unit.variant, unit.backend, self.variant_env.get(unit.variant, {}), log)

    def environ(self, unit: CompileUnit, made: BuildEnvironment | None, shadow: Path | None = None) -> dict[str, str]:
        """The build's variables: the variant's archs and toolchain, its ``build_env``, its environment's tools;
        a cpu variant's build, given a ``shadow`` directory, sees no CUDA toolkit (:func:`hide_cuda_toolkit`)."""
        environ = build_environ(unit.backend, unit.variant, unit.archs, self.toolchain, self.jobs,
                                self.cuda_home, os.environ)
        if unit.backend == "cpu" and shadow is not None:
            environ = hide_cuda_toolkit(environ, shadow)
        environ = without_network(environ) | dict(self.variant_env.get(unit.variant, {}))
        if made is not None:  # its scripts (ninja, cmake) before anything else of that name
            environ["PATH"] = os.pathsep.join(filter(None, [str(made.bin_dir), environ.get("PATH", "")]))
        if unit.arch_policy == "narrow":
            environ = self._narrowed(unit, environ, shadow)
        return environ

    def _narrowed(self, unit: CompileUnit, environ: dict[str, str], shadow: Path | None) -> dict[str, str]:
        """``environ`` whose nvcc (``CUDA_HOME``, ``PYTORCH_NVCC``, ``CUDACXX``, first on ``PATH``) keeps only the
        variant's archs of a ``-gencode`` list the build names itself (:mod:`kiln.tasks.build.nvcc_narrow`)."""
        real = environ.get("CUDA_HOME") or self.cuda_home
        if unit.backend != "cuda" or real is None or shadow is None:
            raise CompileError(f"variant {unit.variant}: arch_policy \"narrow\" narrows a CUDA build's nvcc targets;"
                               f" this is a {unit.backend} build" + ("" if unit.backend != "cuda" else
                                                                       " and no CUDA toolkit (nvcc) was found"))
        archs = [parse_cuda_arch(a) for a in unit.archs]
        cache = (self.compile_cache.launcher, ACTIVE) if self.compile_cache is not None else None
        home = narrowed_cuda_home(Path(real), shadow / NARROWED_HOME, {a.sm for a in archs},
                                  {a.sm for a in archs if a.ptx}, sys.executable, cache, self.cuobjdump)
        nvcc = str(home / "bin" / "nvcc")
        return environ | {"CUDA_HOME": str(home), "CUDA_PATH": str(home), "PYTORCH_NVCC": nvcc, "CUDACXX": nvcc,
                          "PATH": os.pathsep.join(filter(None, [str(home / "bin"), environ.get("PATH", "")]))}

    def _environment(self, root: Path, source: Path, what: str, made: BuildEnvironment | None = None) -> Path:
        """A fresh environment for the build on the variant's (or Kiln's), every build requirement met."""
        python = overlay_env(root, made) if made is not None else venvs.make_build_env(root)
        flag = made.safe_path if made is not None else "-P"  # -P: 3.11+; a Python 3.10 cell's build: -I
        install_build_requirements(python, build_requires(source), what, self.timeout_s, flag)
        return python

    def _built_here(self, wheel: Path, source: Path, dist: Path, what: str, tree: Path | None = None) -> None:
        """Refuse a wheel whose libraries this build did not make: setuptools' build tree (the prebuilt-wheel
        download is a ``bdist_wheel`` pattern), else the CMake or meson build ``tree`` Kiln named
        (:mod:`kiln.tasks.wheel.compiled_here`); other backends are not checked."""
        if not _setuptools(source) and tree is not None:
            foreign = foreign_out_of_tree(wheel, tree)
            if foreign:
                raise CompileError(f"the build of {what} put libraries in its wheel that it did not compile: {foreign}"
                                   f" (no library its {out_of_tree(source)} build tree holds has their machine code:"
                                   " installed from the sources or fetched, not built); build them from source")
            return
        if not _setuptools(source):
            return
        foreign = foreign_binaries(wheel, source, dist)
        if foreign:
            raise CompileError(f"the build of {what} put libraries in its wheel that it did not compile: {foreign}"
                               " (none is in its build tree; a bdist_wheel that downloads a prebuilt wheel does"
                               " this): set the package's *_FORCE_BUILD switch in the variant's build_env")

    def _one_wheel(self, dist: Path, what: str) -> Path:
        wheels = sorted(dist.glob("*.whl"))
        if len(wheels) != 1:
            raise CompileError(f"the build backend of {what} left {len(wheels)} wheels, expected one: {wheels}")
        name = parse_wheel_filename(wheels[0].name)[0]
        if name != canonicalize_name(self.distribution):
            raise CompileError(f"the build backend of {what} built {name!r}, but kiln.toml's project.distribution"
                               f" is {self.distribution!r}; make them agree")
        return wheels[0]


def _cross_target(env: Any, variant: str) -> CrossTarget | None:
    """The CPU ``variant``'s wheel is cross-built for, read from the build's config (None: built natively)."""
    config = getattr(env, "config", None)
    return cross_target_of(config.variant(variant)) if config is not None else None


def _cell_cuda_home(env: Any, variant: str) -> Path | None:
    """The CUDA toolkit of a ``cuda`` axis cell whose release this machine's toolkit is not (the staged wheels'),
    else None (:func:`kiln.tasks.build.cuda_toolkits.cell_cuda_home`)."""
    config = getattr(env, "config", None)
    cell = config.variant(variant).cell if config is not None else None
    release = cell.value("cuda") if cell is not None else None
    return cell_cuda_home(release) if release is not None else None


def _cross_torch(env: Any, variant: str) -> str | None:
    """The torch version a cross-built ``variant`` pins (its extension links that torch's target libraries)."""
    config = getattr(env, "config", None)
    return pinned_version(config.variant(variant).build_requires) if config is not None else None


def _build_torch(environments: VariantEnvironments | None, variant: str, what: str) -> str:
    """The torch a unit builds against: its variant environment's, else the one Kiln's interpreter has."""
    found = environments.torch(variant) if environments is not None else None
    if found is not None:
        return str(found.version)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError as exc:
        raise CompileError(f"{what} has abi = \"stable\" but no torch to build against: add torch to the variant's"
                           " build_requires") from exc


def device_code_json(found: Mapping[str, Any], policy: str, dropped: Sequence[str] = ()) -> bytes:
    """What the unit records of the wheel's device code: each library's archs and all of them together (and,
    under ``narrow``, the targets its build named that Kiln's nvcc dropped)."""
    total = held(dict(found))
    data: dict[str, Any] = {"dropped": sorted(dropped)} if policy == "narrow" else {}
    data |= {"policy": policy, "held": total.describe(), "sass": sorted(total.sass), "ptx": sorted(total.ptx),
            "gfx": sorted(total.gfx), "libraries": {name: c.describe() for name, c in sorted(found.items())}}
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
