"""A CUDA release's compilers for a cell of the ``cuda`` axis: this machine's toolkit when it is that release,
else NVIDIA's CUDA compiler wheel of that release from the machine's index.

A cell of ``cuda = ["12.8", "13.0"]`` compiles its device code with that release's ``ptxas``: Triton's
ahead-of-time kernels take it through ``TRITON_PTXAS_PATH`` (their PTX ISA follows the ``ptxas`` release, so
the 12.8 cell's kernels load on a driver of CUDA 12.8, the 13.0 cell's need 13.0). The compilers come from

- the machine's toolkit (the ``nvcc`` on PATH and the ``ptxas`` beside it) when its release is the cell's;
- else ``nvidia-cuda-nvcc-cu12==<release>.*`` (CUDA 12: ``ptxas`` and NVVM, no ``nvcc``) or
  ``nvidia-cuda-nvcc==<release>.*`` (CUDA 13 and newer: the whole compiler driver), fetched by pip as a wheel
  with no code of it run (``pip download --only-binary :all: --no-deps``: pip checks the sha256 the index
  states), unpacked once per release in Kiln's cache and renamed into place whole.

:func:`toolchain_env` is the ``cuda`` entry's :attr:`~kiln.tasks.project.config_axes.Axis.toolchain`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from kiln.core.errors import CompileError, ToolchainMissingError
from kiln.core.fsutil import polled_lock
from kiln.tasks.build.cross import default_cache_dir
from kiln.tasks.build.guest_install import pip_env
from kiln.tasks.build.nvcc import find_nvcc, run_tool

_log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 900.0
_MARKER = "kiln-cuda-toolkit.json"
_TOOLS = ("ptxas", "nvcc")


def wheel_requirement(release: str) -> str:
    """The compiler wheel of CUDA ``release`` (``"12.8"``): CUDA 12's carries a ``-cu12`` suffix, 13's none."""
    major = int(release.split(".")[0])
    return f"nvidia-cuda-nvcc{'-cu12' if major == 12 else ''}=={release}.*"


def machine_release() -> str | None:
    """The release (``"13.0"``) of the nvcc on PATH, None without one."""
    try:
        return ".".join(find_nvcc().version.split(".")[:2])
    except ToolchainMissingError:
        return None


def _machine_tools(release: str) -> dict[str, Path] | None:
    """This machine's ``nvcc`` and the ``ptxas`` beside it when the toolkit is of ``release``, else None."""
    try:
        nvcc = find_nvcc()
    except ToolchainMissingError:
        return None
    if ".".join(nvcc.version.split(".")[:2]) != release:
        return None
    ptxas = Path(nvcc.path).resolve().parent / "ptxas"
    return {"nvcc": Path(nvcc.path), "ptxas": ptxas} if ptxas.is_file() else None


def staged_toolkit(release: str, cache_dir: Path, timeout_s: float = FETCH_TIMEOUT_S) -> Path:
    """The folder holding CUDA ``release``'s compiler wheel unpacked (its ``bin/ptxas``, maybe ``bin/nvcc``);
    fetched and staged once in ``cache_dir``, one stager at a time."""
    final = cache_dir / f"cuda-{release}"
    if (final / _MARKER).is_file():
        return final
    with polled_lock(cache_dir / f".{final.name}.lock", time.monotonic() + timeout_s,
                     f"staging the CUDA {release} compilers", CompileError):
        if (final / _MARKER).is_file():
            return final
        for stale in cache_dir.glob(f".{final.name}-*"):  # a killed stager's (the lock says none runs)
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a folder without its marker is a killed rename's remains
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{final.name}-") as tmp:
            wheel = _fetch(release, Path(tmp) / "download", timeout_s)
            stage = Path(tmp) / "stage"
            _unpack(wheel, stage, release)
            os.chmod(stage, 0o755)
            os.replace(stage, final)
    _log.info("staged the CUDA %s compilers in %s", release, final)
    return final


def _fetch(release: str, folder: Path, timeout_s: float) -> Path:
    requirement = wheel_requirement(release)
    cmd = [sys.executable, "-I", "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", "--dest", str(folder), requirement]
    _log.info("fetching %s for the CUDA %s cells", requirement, release)
    with tempfile.TemporaryDirectory(prefix="kiln-pip-home-") as home:
        done = run_tool(cmd, timeout_s, env=pip_env(Path(home)))
    wheels = sorted(folder.glob("nvidia_cuda_nvcc*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise CompileError(f"no CUDA {release} compilers: this machine's toolkit is another release and pip found"
                           f" no {requirement} wheel on the machine's index (exit {done.returncode}); install"
                           f" CUDA {release} or drop {release} from the variant's cuda axis. pip's output ends:\n"
                           f"{done.stdout[-2000:].strip()}")
    return wheels[0]


def _unpack(wheel: Path, stage: Path, release: str) -> None:
    """The wheel's ``nvidia/<folder>/`` tree into ``stage`` (members checked), its programs made executable."""
    with zipfile.ZipFile(wheel) as archive:
        members = [info for info in archive.infolist() if re.match(r"^nvidia/[^/]+/", info.filename)
                   and not info.is_dir()]
        for info in members:
            name = info.filename.split("/", 2)[2]
            target = stage / name
            if not target.resolve().is_relative_to(stage.resolve()):
                raise CompileError(f"{wheel.name} has a member outside its folder: {info.filename!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            if (info.external_attr >> 16) & stat.S_IXUSR:
                os.chmod(target, 0o755)
    if not (stage / "bin" / "ptxas").is_file():
        raise CompileError(f"{wheel.name} holds no bin/ptxas: not NVIDIA's CUDA compiler wheel")
    (stage / _MARKER).write_text(json.dumps({"cuda": release, "wheel": wheel.name}, indent=1, sort_keys=True) + "\n")


def toolkits_root() -> Path:
    """Where the staged compilers are kept between builds (made here: the compile workers' sandbox reads it)."""
    root = default_cache_dir().parent / "cuda"
    root.mkdir(parents=True, exist_ok=True)
    return root


def tools(release: str, cache_dir: Path | None = None) -> dict[str, Path]:
    """CUDA ``release``'s ``ptxas`` (and ``nvcc`` where it has one): the machine's, else the staged wheel's."""
    machine = _machine_tools(release)
    if machine is not None:
        return machine
    staged = staged_toolkit(release, cache_dir or toolkits_root())
    return {tool: staged / "bin" / tool for tool in _TOOLS if (staged / "bin" / tool).is_file()}


def toolchain_env(release: str) -> dict[str, str]:
    """What a cell of CUDA ``release`` compiles with: Triton's ``ptxas`` (both of its slots) set to the release's."""
    ptxas = str(tools(release)["ptxas"])
    return {"TRITON_PTXAS_PATH": ptxas, "TRITON_PTXAS_BLACKWELL_PATH": ptxas}


__all__ = ["machine_release", "staged_toolkit", "toolchain_env", "toolkits_root", "tools", "wheel_requirement"]
