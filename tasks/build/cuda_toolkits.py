"""A CUDA release's compilers for a cell of the ``cuda`` axis: this machine's toolkit when it is that release,
else NVIDIA's CUDA compiler wheels of that release from the machine's index.

A cell of ``cuda = ["12.8", "13.0"]`` compiles its device code with that release's compilers. Triton's
ahead-of-time kernels take its ``ptxas`` through ``TRITON_PTXAS_PATH`` (their PTX ISA follows the ``ptxas``
release, so the 12.8 cell's kernels load on a driver of CUDA 12.8, the 13.0 cell's need 13.0); a package's own
native build (a plain CUDA library) gets its ``nvcc`` as ``CUDA_HOME``, ``CUDACXX`` and first on ``PATH``. They
come from

- the machine's toolkit (the ``nvcc`` on PATH and the ``ptxas`` beside it) when its release is the cell's;
- else :func:`wheel_requirements`: CUDA 12's ``nvidia-cuda-nvcc-cu12`` (``ptxas`` and NVVM, no ``nvcc``), or
  CUDA 13's four wheels that unpack into one toolkit tree (``nvcc``, ``cicc``, its headers, the runtime),
  fetched by pip with no code of them run (``pip download --only-binary :all: --no-deps``: pip checks the sha256
  the index states), unpacked once per release in Kiln's cache and renamed into place whole.

:func:`toolchain_env` is the ``cuda`` entry's :attr:`~kiln.tasks.project.config_axes.Axis.toolchain`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from kiln.core.errors import CompileError, ToolchainMissingError
from kiln.core.fsutil import staged_once
from kiln.core.wheels import unpack_member
from kiln.tasks.build.cross import default_cache_dir
from kiln.tasks.build.guest_install import pip_env
from kiln.tasks.build.nvcc import Nvcc, find_nvcc
from kiln.tasks.process import run_tool

_log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 900.0
_MARKER = "kiln-cuda-toolkit.json"
_TOOLS = ("ptxas", "nvcc")


def wheel_requirements(release: str) -> list[str]:
    """NVIDIA's compiler wheels of CUDA ``release`` (``"12.8"``): CUDA 12's one ``-cu12`` wheel (``ptxas`` and NVVM,
    no ``nvcc``); CUDA 13's toolkit, split over four wheels that unpack into one tree (``nvcc``, NVVM's ``cicc``,
    the headers ``nvcc`` includes, the runtime it links)."""
    if int(release.split(".")[0]) == 12:
        return [f"nvidia-cuda-nvcc-cu12=={release}.*"]
    return [f"{name}=={release}.*" for name in ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt",
                                                "nvidia-cuda-runtime")]


def release_of(version: str) -> str:
    """The CUDA release of a toolkit version: ``"13.0.88"`` -> ``"13.0"``."""
    return ".".join(version.split(".")[:2])


@functools.cache
def _machine_nvcc() -> Nvcc | None:
    """The nvcc on PATH, asked once per process; None without one."""
    try:
        return find_nvcc()
    except ToolchainMissingError:
        return None


def machine_release() -> str | None:
    """The release (``"13.0"``) of the nvcc on PATH, None without one."""
    nvcc = _machine_nvcc()
    return release_of(nvcc.version) if nvcc is not None else None


def _machine_tools(release: str) -> dict[str, Path] | None:
    """This machine's ``nvcc`` and the ``ptxas`` beside it when the toolkit is of ``release``, else None."""
    nvcc = _machine_nvcc()
    if nvcc is None or release_of(nvcc.version) != release:
        return None
    ptxas = Path(nvcc.path).resolve().parent / "ptxas"
    return {"nvcc": Path(nvcc.path), "ptxas": ptxas} if ptxas.is_file() else None


def staged_toolkit(release: str, cache_dir: Path, timeout_s: float = FETCH_TIMEOUT_S) -> Path:
    """The folder holding CUDA ``release``'s compiler wheels unpacked (its ``bin/ptxas``, maybe ``bin/nvcc``);
    fetched and staged once in ``cache_dir``, one stager at a time."""
    def make(tmp: Path) -> Path:
        stage = tmp / "stage"
        wheels = _fetch(release, tmp / "download", timeout_s)
        for wheel in wheels:
            _unpack(wheel, stage)
        if not (stage / "bin" / "ptxas").is_file():
            raise CompileError(f"{[w.name for w in wheels]} hold no bin/ptxas: not NVIDIA's CUDA compiler wheels")
        (stage / _MARKER).write_text(json.dumps({"cuda": release, "wheels": [w.name for w in wheels]}, indent=1,
                                                sort_keys=True) + "\n")
        return stage

    final = staged_once(cache_dir / f"cuda-{release}", _MARKER, f"staging the CUDA {release} compilers", make,
                        timeout_s, CompileError)
    _log.debug("the CUDA %s compilers are staged in %s", release, final)
    return final


def _fetch(release: str, folder: Path, timeout_s: float) -> list[Path]:
    requirements = wheel_requirements(release)
    cmd = [sys.executable, "-I", "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", "--dest", str(folder), *requirements]
    _log.info("fetching %s for the CUDA %s cells", requirements, release)
    with tempfile.TemporaryDirectory(prefix="kiln-pip-home-") as home:
        done = run_tool(cmd, timeout_s, env=pip_env(Path(home)))
    wheels = sorted(folder.glob("nvidia_*.whl"))
    if done.returncode != 0 or len(wheels) != len(requirements):
        raise CompileError(f"no CUDA {release} compilers: this machine's toolkit is another release and pip found"
                           f" no {requirements} wheels on the machine's index (exit {done.returncode}); install"
                           f" CUDA {release} or drop {release} from the variant's cuda axis. pip's output ends:\n"
                           f"{done.stdout[-2000:].strip()}")
    return wheels


def _unpack(wheel: Path, stage: Path) -> None:
    """The wheel's ``nvidia/<folder>/`` tree into ``stage`` (members checked), its programs made executable."""
    with zipfile.ZipFile(wheel) as archive:
        members = [info for info in archive.infolist() if re.match(r"^nvidia/[^/]+/", info.filename)
                   and not info.is_dir()]
        for info in members:
            unpack_member(archive, info.filename, stage, info.filename.split("/", 2)[2], wheel.name)


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


def cell_cuda_home(release: str) -> Path | None:
    """The CUDA home a native build of a cell of ``release`` compiles with: None where this machine's toolkit is
    that release (the build finds its own, as any variant's does), else the staged wheels' tree; a CompileError
    naming why for a release whose wheels hold no ``nvcc`` (CUDA 12)."""
    if machine_release() == release:
        return None
    found = tools(release)
    if "nvcc" not in found:
        raise CompileError(f"CUDA {release}: this machine's nvcc is {machine_release() or 'missing'} and NVIDIA's"
                           f" {wheel_requirements(release)} wheels hold no nvcc (ptxas only), so its native code"
                           f" builds only with CUDA {release}'s toolkit installed (its Triton kernels build anywhere);"
                           f" install it or drop {release} from the variant's cuda axis")
    return found["nvcc"].parent.parent


def toolkit_environ(home: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` compiling with the CUDA toolkit at ``home``: its ``nvcc`` first on ``PATH`` and named by the
    variables builds read (``CUDA_HOME``, ``CUDA_PATH``, ``CUDACXX``)."""
    env = dict(environ) | {"CUDA_HOME": str(home), "CUDA_PATH": str(home), "CUDACXX": str(home / "bin" / "nvcc")}
    env["PATH"] = os.pathsep.join(filter(None, [str(home / "bin"), environ.get("PATH", "")]))
    return env


def toolchain_env(release: str) -> dict[str, str]:
    """What a cell of CUDA ``release`` compiles with: Triton's ``ptxas`` (both of its slots) set to the release's."""
    ptxas = str(tools(release)["ptxas"])
    return {"TRITON_PTXAS_PATH": ptxas, "TRITON_PTXAS_BLACKWELL_PATH": ptxas}


__all__ = ["cell_cuda_home", "machine_release", "release_of", "staged_toolkit", "toolchain_env", "toolkit_environ",
           "toolkits_root", "tools", "wheel_requirements"]
