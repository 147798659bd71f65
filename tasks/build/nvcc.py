"""Build a kernel's CUDA C++ sources with ``nvcc`` for exactly the planned archs.

The ``-gencode`` list comes from the arch resolution and nothing else
(``native`` is refused by the arch parser; ``kiln.toml`` flags may not choose
archs). ``[build.toolchain]`` adds include directories, defines, flags and
libraries; with ``torch = true`` the sources are torch extensions, built
against the installed torch's headers, libraries and C++ ABI. After the build, the shared
library's embedded SASS and PTX are listed with ``cuobjdump`` (Triton's wheel
ships one) and compared with the plan, so a flag typo cannot ship a library
that lacks an arch. A missing ``nvcc`` is not an error of the build: its
units are skipped with :func:`missing_reason`'s message and Triton units
still build.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.errors import CompileError, ToolchainMissingError
from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.build import nvcc_arch, stagedir
from kiln.tasks.build.compile_cache import (
    COMPILE_STATS,
    CompileCache,
    CompileStats,
    read_stats_log,
    warn_shared_faults,
)
from kiln.tasks.process import run_tool
from kiln.tasks.project.archs import parse_cuda_arch
from kiln.tasks.project.registry_types import CudaSourceRecord
from kiln.tasks.wheel.devicecode import embedded_archs, expected_contents

if TYPE_CHECKING:
    from kiln.tasks.build.plan import CompileUnit
    from kiln.tasks.project.config import KilnConfig

_log = logging.getLogger(__name__)
_VERSION_TIMEOUT_S = 30


@dataclass(frozen=True)
class Nvcc:
    path: str
    version: str
    cuobjdump: str


def find_cuobjdump() -> str:
    """Triton's cuobjdump (its wheel ships one), else the one on PATH."""
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
    return Nvcc(chosen, match[1], find_cuobjdump())


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


@dataclass(frozen=True)
class NvccSettings:
    """What ``kiln.toml``'s ``[build.toolchain]`` (and, for torch extensions, the installed torch) adds to nvcc."""

    include_dirs: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    library_dirs: tuple[str, ...] = ()

    def __add__(self, other: NvccSettings) -> NvccSettings:
        return NvccSettings(*(a + b for a, b in zip(self.fields(), other.fields(), strict=True)))

    def fields(self) -> tuple[tuple[str, ...], ...]:
        return self.include_dirs, self.defines, self.flags, self.libraries, self.library_dirs

    def compile_args(self) -> list[str]:
        return [*(f"-I{d}" for d in self.include_dirs), *(f"-D{d}" for d in self.defines), *self.flags]

    def link_args(self) -> list[str]:
        return [*(f"-L{d}" for d in self.library_dirs), *(f"-l{lib}" for lib in self.libraries)]


_TORCH_PATHS = ("import json, torch\nfrom torch.utils import cpp_extension as c\n"
                "abi = int(bool(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True)))\n"
                "print('KILN-TORCH ' + json.dumps([c.include_paths(), c.library_paths(), abi]))\n")
_TORCH_TIMEOUT_S = 180


def torch_settings(python: str | None = None) -> NvccSettings:
    """Build against a torch: its headers, its libraries and its C++ ABI.

    ``python``: the interpreter of the environment whose torch it is (a variant's build environment),
    asked with ``python -I -c``; None: the torch installed here, imported.
    No rpath: the library is loaded by ``torch.ops.load_library`` after torch
    itself, whose ``libc10``/``libtorch_cpu`` then satisfy its dependencies.
    """
    if python is not None:
        done = run_tool([python, "-I", "-c", _TORCH_PATHS], _TORCH_TIMEOUT_S)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("KILN-TORCH ")]
        if done.returncode != 0 or not found:
            raise ToolchainMissingError(f"cannot read torch's include and library dirs with {python}"
                                        f" (exit {done.returncode}):\n{done.stdout[-2000:]}")
        import json

        includes, libs, abi = json.loads(found[-1].removeprefix("KILN-TORCH "))
        return NvccSettings(tuple(includes), (f"_GLIBCXX_USE_CXX11_ABI={abi}",), ("-std=c++17",),
                            ("c10", "torch", "torch_cpu"), tuple(libs))
    import torch
    from torch.utils import cpp_extension

    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return NvccSettings(tuple(cpp_extension.include_paths()), (f"_GLIBCXX_USE_CXX11_ABI={abi}",),
                        ("-std=c++17",), ("c10", "torch", "torch_cpu"), tuple(cpp_extension.library_paths()))


def settings_for(config: KilnConfig, python: str | None = None) -> NvccSettings:
    """The nvcc settings of ``config``'s ``[build.toolchain]`` (paths resolved against kiln.toml);
    ``python``: the build environment whose torch a torch extension builds against (default: Kiln's)."""
    toolchain = config.build.toolchain
    own = NvccSettings(tuple(str(config.path(d)) for d in toolchain.include_dirs), toolchain.defines,
                       toolchain.nvcc_flags, toolchain.libraries,
                       tuple(str(config.path(d)) for d in toolchain.library_dirs))
    return torch_settings(python) + own if toolchain.torch else own


def _named_paths(args: Sequence[str]) -> list[str]:
    """The absolute paths compile and link flags name (``-I``, ``-isystem``, ``-L``, a library file, an rpath):
    what the compiler and the linker read."""
    found = []
    for arg in args:
        for part in arg.split(","):  # -Wl,-rpath,/a/b
            path = part[2:] if part[:2] in ("-I", "-L") else part
            if os.path.isabs(path) and os.path.exists(path):
                found.append(path)
    return found


def _guest(cmd: list[str], read: Sequence[str | os.PathLike[str]],
           write: Sequence[str | os.PathLike[str]]) -> list[str]:
    return guest_command(cmd, read=[*read, str(Path(cmd[0]).resolve().parent.parent)], write=write, network="none")


def build_library(nvcc: Nvcc, sources: list[Path], library: str, archs: tuple[str, ...], timeout: float,
                  settings: NvccSettings = NvccSettings(), cache: CompileCache | None = None) -> bytes:
    """Compile ``sources`` into one shared library for ``archs``; return its bytes after the arch check."""
    return build_library_counted(nvcc, sources, library, archs, timeout, settings, cache)[0]


def _stage_name(library: str, sources: list[Path]) -> str:
    """What the staging directory is named by: the library and its sources' names, never their content nor
    the archs (a one-file change or an added arch keeps the path, so the cached objects of the other files
    and of the other archs still apply: the path is part of every compile's command line)."""
    origin = Path(os.path.commonpath([str(s.resolve().parent) for s in sources]))
    names = sorted(s.resolve().relative_to(origin).as_posix() for s in sources)
    return hashlib.sha256("\0".join([library, *names]).encode()).hexdigest()[:16]


def _plain_runner(env: Mapping[str, str] | None = None) -> nvcc_arch.ToolRunner:
    """The per-arch combiner's tools run through :func:`run_tool` (here, not in nvcc_arch: that would be a cycle)."""
    def run(cmd: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
        _log.debug("running %s", " ".join(cmd))
        return run_tool(cmd, timeout, cwd=cwd, env=env)
    return run


def build_library_counted(nvcc: Nvcc, sources: list[Path], library: str, archs: tuple[str, ...], timeout: float,
                          settings: NvccSettings = NvccSettings(),
                          cache: CompileCache | None = None) -> tuple[bytes, CompileStats]:
    """:func:`build_library`, and which translation units were compiled and which the compile ``cache`` served.

    Each source is compiled to its own object (through ``cache``'s launcher when there is one), a ``.cu``
    once per arch and combined (:mod:`kiln.tasks.build.nvcc_arch`), then the objects are linked. The
    sources are compiled from a directory whose path depends only on what is built
    (:func:`kiln.tasks.build.stagedir.fixed_sources`), so the library's bytes do not depend on where the
    checkout lives (invariant 8) nor on whether an object came from the cache.
    """
    deadline = time.monotonic() + timeout
    with (tempfile.TemporaryDirectory(prefix="kiln-nvcc-") as tmp,
          stagedir.fixed_sources(sources, _stage_name(library, sources), timeout) as (root, staged)):
        log = Path(tmp) / "compile-cache.log"
        env = guest_environ(Path(tmp) / "home", cache.environ(root, log) if cache is not None else {})
        launcher = cache.prefix() if cache is not None else []
        # the package's sources compile as guests: the staged sources, the toolchain and the include folders
        # read; this compile's folder and the compile cache written; no network (a source cannot #include a
        # credential file or the user's home into the library)
        guest = functools.partial(_guest, read=[root, Path(nvcc.path).resolve().parent.parent,
                                                *_named_paths([*settings.compile_args(), *settings.link_args()]),
                                                *(cache.read_paths() if cache is not None else [])],
                                  write=[tmp, *(cache.write_paths() if cache is not None else [])])
        tools = nvcc_arch.find_combine_tools(nvcc.path, nvcc.cuobjdump)
        per_arch = [(parse_cuda_arch(name).sm, gencode_flags((name,))) for name in archs]
        objects: list[str] = []
        compiled: list[str] = []
        reused: list[str] = []
        shared: list[str] = []  # of reused, those the team's shared tier served
        faults = 0
        served: dict[Path, CompileStats] = {}  # object -> what the compile cache's log says of it
        for number, source in enumerate(staged):
            obj = Path(tmp) / f"{number}-{source.name}.o"
            # -ffile-prefix-map: __FILE__ and debug paths name the staged directory as '.'.
            base = [*launcher, nvcc.path, "-c", "-Xcompiler", "-fPIC", "-O3", "-Xcompiler",
                    f"-ffile-prefix-map={root}=.", *settings.compile_args()]

            def compile_one(flags: list[str], out: Path, base: list[str] = base, source: Path = source) -> None:
                # each compile logs to its own statistics file: which arch of which source the cache served
                call_log = Path(tmp) / f"{out.name}.ccache.log"
                call_env = {**env, "CCACHE_STATSLOG": str(call_log)} if cache is not None else env
                cmd = [*base, *flags, "-o", str(out), source.relative_to(root).as_posix()]
                result = run_tool(guest(cmd), max(deadline - time.monotonic(), 1.0), cwd=root, env=call_env)
                if result.returncode != 0:
                    raise CompileError(f"nvcc failed on {source.name} for {library} ({', '.join(archs)}):\n"
                                       f"{result.stdout[-4000:]}")
                if cache is not None:
                    served[out] = read_stats_log(call_log)

            for label, written in nvcc_arch.compile_translation_unit(source, obj, per_arch, compile_one, tools,
                                                                     _plain_runner(env)):
                logged = served.get(written, CompileStats())
                (reused if logged.reused else compiled).append(label)
                shared += [label] if logged.shared else []
                faults += logged.shared_faults
            objects.append(str(obj))
        out = Path(tmp) / library
        # -s: no .symtab, whose FILE symbols name nvcc's per-process temporary files (tmpxft_<pid>_…).
        # The archs again: without them nvcc's link adds its default arch's (sm_75) device code.
        cmd = [nvcc.path, "-shared", "-Xlinker", "-s", "-o", str(out), *objects, *gencode_flags(archs),
               *settings.link_args()]
        result = run_tool(guest(cmd), max(deadline - time.monotonic(), 1.0), cwd=root, env=env)
        if result.returncode != 0:
            raise CompileError(f"nvcc could not link {library} ({', '.join(archs)}):\n{result.stdout[-4000:]}")
        sass, ptx = embedded_archs(out, nvcc.cuobjdump)
        want_sass, want_ptx = expected_contents(archs)
        if sass != want_sass or not want_ptx <= ptx:
            raise CompileError(f"{library}: embeds SASS {sorted(sass)} and PTX {sorted(ptx)}, the plan asked for"
                               f" SASS {sorted(want_sass)} and PTX {sorted(want_ptx)}")
        stats = warn_shared_faults(CompileStats(tuple(compiled), tuple(reused), tuple(shared), faults), library)
        return out.read_bytes(), stats


@dataclass(frozen=True)
class NvccBuilder:
    """The build stage's nvcc backend: builds one ``nvcc`` unit of the plan."""

    nvcc: Nvcc
    package_dir: Path
    csrc: Mapping[str, CudaSourceRecord]  # kernel name -> its CUDA sources, as the registry loader read them
    settings: NvccSettings = NvccSettings()
    cache: CompileCache | None = None  # the per-translation-unit compile cache (kiln.tasks.build.compile_cache)

    # Any: a CompileContext: kiln.tasks.build.units imports this module, so naming it here is a cycle
    def build_unit(self, unit: CompileUnit, env: Any) -> dict[str, bytes]:
        """The library, and under :data:`COMPILE_STATS` what was compiled (taken out before it is cached)."""
        csrc = self.csrc[unit.kernel]
        paths = [self.package_dir / s for s in csrc.sources]
        data, stats = build_library_counted(self.nvcc, paths, csrc.library, unit.archs, env.timeout_s,
                                            self.settings, self.cache)
        return {csrc.library: data, COMPILE_STATS: json.dumps(stats.as_dict()).encode()}
