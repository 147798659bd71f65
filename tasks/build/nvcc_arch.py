"""Compile a CUDA translation unit once per arch, then combine the per-arch device code into one object.

ccache keys an nvcc call on its whole command line, so one call with every ``-gencode`` of a variant would
recompile every arch of every translation unit when the variant gains one arch. Here each arch is its own
nvcc call (one ``-gencode``, with the PTX entry where the variant asks for PTX), each through the compile
cache, so adding an arch compiles that arch alone and the others are served.

How the per-arch objects become one: a non-relocatable nvcc object is host code plus the fat binary of
its device code in the ``.nv_fatbin`` section, which the host code registers through a pointer to that
section's start (``fatbinData``); the host code itself does not depend on the arch it was compiled with
(only the ``FILE`` symbol naming nvcc's temporary file differs, and the link strips it). So the images
(cubins and PTX) of every per-arch object are taken out with ``cuobjdump``, packed into one fat binary
with the toolkit's ``fatbinary`` in the variant's arch order, and put in place of the first object's
``.nv_fatbin`` with ``objcopy``. Every step is a pure function of its input bytes, so the object is the
same whether a per-arch compile hit the cache or ran (invariant 8); a cold build takes this same path, so
cold and warm agree by construction. (With CUDA 13 the packed fat binary is byte-identical to the one a
single nvcc call with all the archs embeds.) Relocatable device code (``-rdc``/``-dlink``) would also
split per arch, but it changes how the package's code links and runs; this path leaves that untouched.

Only ``.cu`` sources carry device code: other sources compile once, with no ``-gencode``, so an arch
added to the variant does not recompile them either.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import CompileError, ToolchainMissingError

_log = logging.getLogger(__name__)
_TOOL_TIMEOUT_S = 120
_IMAGE = re.compile(r"\.(\d+)\.sm_(\d+[af]?)\.(cubin|ptx)$")
_KIND = {"cubin": "elf", "ptx": "ptx"}

# runs one tool: (argv, timeout s, working directory) -> its completed process
ToolRunner = Callable[[list[str], float, Path], "subprocess.CompletedProcess[str]"]
# compiles the source with these extra flags (one arch's -gencode, or none) into this object
CompileOne = Callable[[list[str], Path], None]


@dataclass(frozen=True)
class CombineTools:
    """The toolkit's ``fatbinary``, binutils' ``objcopy`` and a ``cuobjdump``."""

    fatbinary: str
    objcopy: str
    cuobjdump: str


def find_combine_tools(nvcc_path: str, cuobjdump: str) -> CombineTools:
    """``fatbinary`` beside ``nvcc_path`` (the same toolkit), ``objcopy`` from PATH."""
    fatbinary = Path(nvcc_path).resolve().parent / "fatbinary"
    objcopy = shutil.which("objcopy")
    if not fatbinary.is_file():
        raise ToolchainMissingError(f"fatbinary not found beside {nvcc_path}: the CUDA toolkit is incomplete")
    if objcopy is None:
        raise ToolchainMissingError("objcopy not found on PATH (binutils): per-arch device code cannot be combined")
    return CombineTools(str(fatbinary), objcopy, cuobjdump)


def carries_device_code(source: Path) -> bool:
    return source.suffix == ".cu"


def compile_translation_unit(source: Path, obj: Path, per_arch: Sequence[tuple[str, list[str]]],
                             compile_one: CompileOne, tools: CombineTools, run: ToolRunner) -> list[tuple[str, Path]]:
    """Compile ``source`` into ``obj``: once per ``(sm, gencode flags)`` of ``per_arch`` and combined for a
    ``.cu``, once with no ``-gencode`` otherwise. Returns each compilation's label (``"<name> [sm_80]"``
    per arch, or the source's name) and the object it wrote, in order."""
    if not carries_device_code(source):
        compile_one([], obj)
        return [(source.name, obj)]
    parts = []
    for sm, flags in per_arch:
        part = obj.with_name(f"{obj.name}.{sm}.o")
        compile_one(flags, part)
        parts.append(part)
    combine(list(zip((sm for sm, _ in per_arch), parts, strict=True)), obj, tools, run, source.name)
    return [(f"{source.name} [{sm}]", part) for (sm, _), part in zip(per_arch, parts, strict=True)]


def _checked(run: ToolRunner, cmd: list[str], cwd: Path) -> str:
    result = run(cmd, _TOOL_TIMEOUT_S, cwd)
    if result.returncode != 0:
        raise CompileError(f"{Path(cmd[0]).name} failed while combining per-arch device code"
                           f" ({' '.join(cmd[1:])}):\n{result.stdout[-2000:]}")
    return result.stdout


def _images(part: Path, tools: CombineTools, run: ToolRunner) -> list[Path]:
    """The cubins and PTX embedded in ``part``, extracted into a folder of their own, in embedded order."""
    folder = part.with_name(part.name + ".images")
    folder.mkdir()
    fatbin = folder / "device.fatbin"
    _checked(run, [tools.objcopy, "-O", "binary", "--only-section=.nv_fatbin", str(part), str(fatbin)], folder)
    if not fatbin.is_file() or fatbin.stat().st_size == 0:
        return []
    _checked(run, [tools.cuobjdump, "-xelf", "all", "-xptx", "all", fatbin.name], folder)
    found = [(m, p) for p in folder.iterdir() if (m := _IMAGE.search(p.name))]
    # cubin before PTX for one arch, as nvcc orders an entry's code list
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0][1]), mp[0][3] != "cubin"))]


def combine(parts: Sequence[tuple[str, Path]], obj: Path, tools: CombineTools, run: ToolRunner,
            name: str = "") -> None:
    """One object: the first part's host code with every part's device images packed into one fat binary.

    ``parts``: each arch (``sm_80``) and the object compiled for it alone; an object whose images are of
    another arch (a flag that dropped or changed the ``-gencode``) is a :class:`CompileError` naming it, a
    check the linked library cannot make (nvcc's link adds a small image for every arch it is given)."""
    images = []
    for sm, part in parts:
        found = _images(part, tools, run)
        other = sorted({f"sm_{m[2]}" for m in map(_IMAGE.search, (p.name for p in found)) if m} - {sm})
        if other:
            raise CompileError(f"{name or part.name} compiled for {sm} alone embeds device code for {other}:"
                               " its -gencode flags did not ask for that arch")
        images += found
    if not images:  # no device code at all: any part is the whole object
        shutil.copyfile(parts[0][1], obj)
        return
    specs = []
    for image in images:
        match = _IMAGE.search(image.name)
        assert match is not None  # _images kept only names that match
        specs.append(f"--image3=kind={_KIND[match[3]]},sm={match[2]},file={image}")
    packed = obj.with_name(obj.name + ".fatbin")
    _checked(run, [tools.fatbinary, "-64", f"--create={packed}", *specs], obj.parent)
    _checked(run, [tools.objcopy, f"--update-section=.nv_fatbin={packed}", str(parts[0][1]), str(obj)],
             obj.parent)
