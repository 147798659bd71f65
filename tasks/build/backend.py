"""``[build] backend = "pep517"``: the project's own build backend builds each variant's wheel.

One unit per variant (see :func:`kiln.tasks.build.plan.plan_variant`). The
unit copies the project's files (git's list: tracked and untracked-not-ignored
files; the whole tree less build outputs outside git) into a private
directory, so no variant reuses another's objects, and runs ``pip wheel
--no-deps --no-build-isolation`` there in a fresh virtual environment made for
the unit. That environment sees Kiln's interpreter's packages after its own
(as a test environment does): the installed torch, which a cpp_extension
build compiles against and which an isolated build could not fetch offline;
build requirements it lacks are installed into it. The variant's filtered
arch list is exported in the forms the ecosystem reads, the toolchain
settings through the compilers' own variables (:func:`build_environ`). The
wheel then goes through :func:`kiln.tasks.build.devicecode.check_wheel`.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import canonicalize_name, parse_wheel_filename

from kiln.release.errors import CompileError
from kiln.tasks.build.archs import parse_cuda_arch
from kiln.tasks.build.devicecode import check_wheel
from kiln.tasks.build.nvcc import run_tool
from kiln.tasks.build.sources import project_files
from kiln.tasks.config_build import Toolchain
from kiln.tasks.testing import envs

if TYPE_CHECKING:
    from kiln.tasks.build.plan import CompileUnit

_log = logging.getLogger("kiln.build.backend")
_TAIL_CHARS = 4000
# Inherited variables that choose archs or flags: the variant's values replace them, never mix with them.
_OWNED = ("TORCH_CUDA_ARCH_LIST", "CMAKE_CUDA_ARCHITECTURES", "CUDAARCHS", "PYTORCH_ROCM_ARCH", "HIPARCHS",
          "NVCC_APPEND_FLAGS", "HIPCC_COMPILE_FLAGS_APPEND", "KILN_VARIANT", "KILN_BACKEND")
DEFAULT_BUILD_REQUIRES = ("setuptools>=40.8.0",)  # PEP 518's default for a pyproject.toml without [build-system]


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
        env |= {"PYTORCH_ROCM_ARCH": ";".join(archs), "HIPARCHS": ";".join(archs)}
    common = [*(f"-I{d}" for d in toolchain.include_dirs), *(f"-D{d}" for d in toolchain.defines)]
    if common or toolchain.nvcc_flags:
        env["NVCC_APPEND_FLAGS"] = shlex.join([*common, *toolchain.nvcc_flags])
    if common or toolchain.hipcc_flags:
        env["HIPCC_COMPILE_FLAGS_APPEND"] = shlex.join([*common, *toolchain.hipcc_flags])
    links = [*(f"-L{d}" for d in toolchain.library_dirs), *(f"-l{lib}" for lib in toolchain.libraries)]
    if links:
        env["LDFLAGS"] = " ".join(filter(None, [base.get("LDFLAGS", ""), shlex.join(links)]))
    return env


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
    data = tomllib.loads((project_dir / "pyproject.toml").read_text())
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

    def build_unit(self, unit: CompileUnit, env: Any) -> dict[str, bytes]:
        """Build the variant's wheel, check its device code; ``{wheel filename: bytes}``."""
        what = f"{self.distribution} (variant {unit.variant}, {unit.backend} {list(unit.archs) or 'no archs'})"
        if unit.backend == "cuda" and self.cuobjdump is None:
            raise CompileError(f"{what}: cuobjdump not found (Triton's package or PATH), so the wheel's device code"
                               " cannot be checked; install Triton or the CUDA toolkit")
        with tempfile.TemporaryDirectory(prefix="kiln-pep517-") as tmp:
            source, dist = Path(tmp) / "src", Path(tmp) / "dist"
            for name in project_files(self.project_dir):
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.project_dir / name, source / name)
            python = self._environment(Path(tmp) / "env", source, what)
            environ = build_environ(unit.backend, unit.variant, unit.archs, self.toolchain, self.jobs,
                                    self.cuda_home, os.environ)
            _log.info("building %s with its own backend", what)
            result = run_tool([str(python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                               "--wheel-dir", str(dist), str(source)], self.timeout_s, cwd=source, env=environ)
            if result.returncode != 0:
                raise CompileError(f"the build backend failed for {what} (exit {result.returncode});"
                                   f" its log ends:\n{_tail(result.stdout)}")
            wheel = self._one_wheel(dist, what)
            check_wheel(wheel, unit.backend, unit.archs, self.cuobjdump)
            return {wheel.name: wheel.read_bytes()}

    def _environment(self, root: Path, source: Path, what: str) -> Path:
        """A fresh environment for the build, every build requirement met."""
        python = envs.make_build_env(root)
        missing = envs.unmet_requirements(python, build_requires(source))
        if missing:
            wanted = [m.rsplit(" (", 1)[0] for m in missing]
            _log.info("installing the build requirements %s for %s", wanted, what)
            done = run_tool([str(python), "-m", "pip", "install", "--quiet", *wanted], self.timeout_s)
            if done.returncode != 0:
                raise CompileError(f"cannot install the build requirements {wanted} of {what}:\n{_tail(done.stdout)}")
        return python

    def _one_wheel(self, dist: Path, what: str) -> Path:
        wheels = sorted(dist.glob("*.whl"))
        if len(wheels) != 1:
            raise CompileError(f"the build backend of {what} left {len(wheels)} wheels, expected one: {wheels}")
        name = parse_wheel_filename(wheels[0].name)[0]
        if name != canonicalize_name(self.distribution):
            raise CompileError(f"the build backend of {what} built {name!r}, but kiln.toml's project.distribution"
                               f" is {self.distribution!r}; make them agree")
        return wheels[0]
