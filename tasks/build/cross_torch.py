"""torch for a cross build: a torch C++ extension's aarch64 wheel, built on this x86_64 builder.

An extension compiles against torch's headers and links torch's libraries (``libc10``, ``libtorch``,
``libtorch_cpu``, ``libtorch_python``). This builder's torch drives the build as always
(``torch.utils.cpp_extension``: its flags, its ``BuildExtension``); the target's torch, of the same version,
supplies what the compiler and the linker read:

- its wheel is fetched from the machine's index by pip, for the target's platform and this CPython, without
  its dependencies and with no code of it run (``pip download --only-binary :all:``: a wheel is only
  unpacked, and pip checks the sha256 the index states);
- its headers (``torch/include``) and the libraries an extension links (:data:`LINKED`) are staged once per
  version, CPU and CPython in the cross cache, renamed into place whole;
- the build gets them first: ``-I`` in ``CFLAGS``/``CXXFLAGS`` (before the builder's torch headers that
  ``cpp_extension`` adds after them) and ``-L`` in ``LDFLAGS`` (GNU ld skips the builder's x86_64 libraries
  in the later folder as incompatible). Their path is mapped in the debug info, as the CPython headers' is.

The version is the one the variant pins (``build_requires = ["torch==2.13.0"]``): the wheel then requires that
torch, and its aarch64 build runs with it. What the target's torch needs at run time (its CUDA libraries on
Grace) is installed with it on the target machine, never here.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from kiln.core.errors import CompileError
from kiln.core.fsutil import staged_once
from kiln.core.wheels import unpack_member
from kiln.tasks.build.cross import CrossTarget
from kiln.tasks.build.guest_install import pip_env
from kiln.tasks.process import run_tool

_log = logging.getLogger(__name__)
LINKED = ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so")
FETCH_TIMEOUT_S = 900.0
_MARKER = "kiln-cross-torch.json"
# The platform tags a target torch wheel may carry, newest first (pip takes any of them).
_MANYLINUX = ("manylinux_2_28", "manylinux_2_17", "manylinux2014")


def _python_tag() -> str:
    return f"{sys.version_info.major}{sys.version_info.minor}"


def staged_torch(cross: CrossTarget, version: str, cache_dir: Path, timeout_s: float = FETCH_TIMEOUT_S) -> Path:
    """The folder holding the target's ``torch/include`` and ``torch/lib`` (:data:`LINKED`) of torch
    ``version`` for this CPython; fetched and staged once in ``cache_dir``, one stager at a time."""
    def make(tmp: Path) -> Path:
        wheel = _fetch(cross, version, tmp / "download", timeout_s)
        _unpack(wheel, tmp / "stage", cross, version)
        return tmp / "stage"

    final = staged_once(cache_dir / f"torch-{version}-cp{_python_tag()}-{cross.platform}", _MARKER,
                        f"staging the {cross.platform} torch {version}", make, timeout_s, CompileError)
    _log.debug("the %s torch %s headers and libraries are staged in %s", cross.platform, version, final)
    return final


def _fetch(cross: CrossTarget, version: str, folder: Path, timeout_s: float) -> Path:
    platforms = [option for tag in _MANYLINUX for option in ("--platform", f"{tag}_{cross.platform}")]
    cmd = [sys.executable, "-I", "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", *platforms, "--python-version", f"{sys.version_info.major}."
           f"{sys.version_info.minor}", "--implementation", "cp", "--abi", f"cp{_python_tag()}",
           "--dest", str(folder), f"torch=={version}"]
    _log.info("fetching the %s torch %s wheel for the cross build", cross.platform, version)
    with tempfile.TemporaryDirectory(prefix="kiln-pip-home-") as home:
        done = run_tool(cmd, timeout_s, env=pip_env(Path(home)))
    wheels = sorted(folder.glob(f"torch-*-cp{_python_tag()}-*_{cross.platform}.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise CompileError(f"no {cross.platform} torch {version} wheel for CPython {_python_tag()} on the machine's"
                           f" index (pip download, exit {done.returncode}): a cross-built torch extension links"
                           f" that torch's libraries; pip's output ends:\n{done.stdout[-2000:].strip()}")
    return wheels[0]


def _unpack(wheel: Path, stage: Path, cross: CrossTarget, version: str) -> None:
    linked = {f"torch/lib/{name}" for name in LINKED}
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if (n.startswith("torch/include/") or n in linked)
                 and not n.endswith("/")]
        missing = sorted(linked - set(names))
        if missing:
            raise CompileError(f"{wheel.name} holds no {', '.join(missing)}: not a torch a C++ extension can link")
        for name in names:
            unpack_member(archive, name, stage, name, wheel.name)
    (stage / _MARKER).write_text(json.dumps({"torch": version, "platform": cross.platform, "wheel": wheel.name},
                                            indent=1, sort_keys=True) + "\n")


def torch_environ(staged: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` compiling against the staged target torch's headers and linking its libraries first."""
    include = staged / "torch" / "include"
    mapped = f"-ffile-prefix-map={staged}=/kiln/cross-torch"
    first = f"-I{include} -I{include / 'torch' / 'csrc' / 'api' / 'include'}"
    env = dict(environ)
    for name in ("CFLAGS", "CXXFLAGS"):
        env[name] = " ".join(filter(None, [first, environ.get(name, ""), mapped]))
    env["LDFLAGS"] = " ".join(filter(None, [f"-L{staged / 'torch' / 'lib'}", environ.get("LDFLAGS", "")]))
    return env


__all__ = ["LINKED", "staged_torch", "torch_environ"]
