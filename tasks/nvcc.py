"""Build a kernel's CUDA C++ sources with ``nvcc`` for exactly the planned archs.

The ``-gencode`` list comes from the arch resolution and nothing else
(``native`` is refused by the arch parser). After the build, the shared
library's embedded SASS and PTX are listed with ``cuobjdump`` (Triton's wheel
ships one) and compared with the plan, so a flag typo cannot ship a library
that lacks an arch. A missing ``nvcc`` is not an error of the build: its
units are skipped with :func:`missing_reason`'s message and Triton units
still build.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from release.errors import CompileError, ToolchainMissingError
from tasks.archs import parse_cuda_arch

_log = logging.getLogger("kiln.nvcc")
_VERSION_TIMEOUT_S = 30
_LIST_TIMEOUT_S = 60
_ELF = re.compile(r"^ELF file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.cubin\s*$", re.M)
_PTX = re.compile(r"^PTX file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.ptx\s*$", re.M)


def run_tool(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run an external tool in its own process group, logged, with a deadline."""
    _log.info("running %s", " ".join(cmd))
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            raise CompileError(f"{cmd[0]} ran past its {timeout:g} s deadline and was terminated:\n{out[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@dataclass(frozen=True)
class Nvcc:
    path: str
    version: str
    cuobjdump: str


def _cuobjdump() -> str:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("cuobjdump")
    if not found:
        raise ToolchainMissingError("cuobjdump not found (neither in Triton's package nor on PATH)")
    return found


def find_nvcc(path: str | None = None) -> Nvcc:
    """The nvcc at ``path`` (default: the one on PATH) and its version.

    Raises :class:`ToolchainMissingError` when it does not exist or does not run.
    """
    chosen = path or shutil.which("nvcc")
    if not chosen or not Path(chosen).is_file():
        raise ToolchainMissingError(f"nvcc not found at {chosen or 'PATH'}")
    result = run_tool([chosen, "--version"], _VERSION_TIMEOUT_S)
    match = re.search(r"release [0-9.]+, V([0-9.]+)", result.stdout)
    if result.returncode != 0 or not match:
        raise ToolchainMissingError(f"{chosen} --version failed: {result.stdout[-500:]}")
    return Nvcc(chosen, match[1], _cuobjdump())


def missing_reason(exc: ToolchainMissingError) -> str:
    return f"CUDA C++ units skipped: {exc}; install the CUDA toolkit or set the nvcc path. Triton units still build"


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """``("8.0", "12.0+PTX")`` -> ``-gencode arch=compute_80,code=sm_80 ...``."""
    flags = []
    for name in archs:
        arch = parse_cuda_arch(name)
        code = f"[{arch.sm},{arch.compute}]" if arch.ptx else arch.sm
        flags += ["-gencode", f"arch={arch.compute},code={code}"]
    return flags


def expected_contents(archs: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(SASS archs, PTX archs) a library built with :func:`gencode_flags` must embed."""
    parsed = [parse_cuda_arch(a) for a in archs]
    return {a.sm for a in parsed}, {a.sm for a in parsed if a.ptx}


def embedded_archs(library: Path, cuobjdump: str) -> tuple[set[str], set[str]]:
    """(SASS archs, PTX archs) embedded in ``library``, read with cuobjdump."""
    elf = run_tool([cuobjdump, "--list-elf", str(library)], _LIST_TIMEOUT_S)
    ptx = run_tool([cuobjdump, "--list-ptx", str(library)], _LIST_TIMEOUT_S)
    if elf.returncode != 0:
        raise CompileError(f"cuobjdump could not read {library.name}: {elf.stdout[-500:]}")
    return set(_ELF.findall(elf.stdout)), set(_PTX.findall(ptx.stdout)) if ptx.returncode == 0 else set()


def build_library(nvcc: Nvcc, sources: list[Path], library: str, archs: tuple[str, ...], timeout: float) -> bytes:
    """Compile ``sources`` into one shared library for ``archs``; return its bytes after the arch check."""
    with tempfile.TemporaryDirectory(prefix="kiln-nvcc-") as tmp:
        out = Path(tmp) / library
        cmd = [nvcc.path, "-shared", "-Xcompiler", "-fPIC", "-O3", "-o", str(out), *map(str, sources), *gencode_flags(archs)]
        result = run_tool(cmd, timeout, cwd=Path(tmp))
        if result.returncode != 0:
            raise CompileError(f"nvcc failed for {library} ({', '.join(archs)}):\n{result.stdout[-4000:]}")
        sass, ptx = embedded_archs(out, nvcc.cuobjdump)
        want_sass, want_ptx = expected_contents(archs)
        if sass != want_sass or not want_ptx <= ptx:
            raise CompileError(f"{library}: embeds SASS {sorted(sass)} and PTX {sorted(ptx)}, the plan asked for"
                               f" SASS {sorted(want_sass)} and PTX {sorted(want_ptx)}")
        return out.read_bytes()


@dataclass(frozen=True)
class NvccBuilder:
    """The build stage's nvcc backend: builds one ``nvcc`` unit of the plan."""

    nvcc: Nvcc
    package_dir: Path
    sources: dict[str, tuple[str, ...]]  # kernel name -> sources relative to the package

    def build_unit(self, unit: Any, env: Any) -> dict[str, bytes]:
        paths = [self.package_dir / s for s in self.sources[unit.kernel]]
        return {unit.entry: build_library(self.nvcc, paths, unit.entry, unit.archs, env.timeout_s)}
