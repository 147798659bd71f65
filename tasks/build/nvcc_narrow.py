"""``arch_policy = "narrow"``: a ``pep517`` build that hard-codes its own ``-gencode`` list gets the variant's archs.

Many CUDA extension packages (flash-attention and the packages that copy its ``setup.py``: causal-conv1d,
mamba-ssm, ...) ignore ``TORCH_CUDA_ARCH_LIST`` and pass nvcc a fixed list of targets, nine archs for
causal-conv1d. Under ``narrow`` the build sees a CUDA home of its own (:func:`narrowed_cuda_home`: links to the
real toolkit, but ``bin/nvcc`` is Kiln's nvcc, :mod:`kiln.tasks.build.nvcc_split`) whose nvcc drops every target
outside the variant's archs before it runs the real nvcc, and says what it dropped (on stderr and in a log the
unit reads). Given the build's compile cache (``launcher``: ccache), it runs the real nvcc through it with the
narrowed flags, split per arch: the narrowing runs on every compile, a hit included, so its record is whole and
the cache keys the flags nvcc ran.
A compile whose targets are none of the variant's archs is refused, never compiled for something else; the
wheel is then checked as under ``exact``: it holds exactly what Kiln compiled for the archs it records.

This module reads nvcc's targets and writes the CUDA home; it imports nothing of Kiln, and Kiln's nvcc imports it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_GENCODE = ("-gencode", "--generate-code")
_ARCH = ("-arch", "--gpu-architecture")
_CODE = ("-code", "--gpu-code")
_CODE_NAME = re.compile(r"^(sm|compute|lto)_([0-9]+[af]?)$")
LOG_NAME = "narrowed.jsonl"  # beside the shim's bin/: one JSON line per compile it changed


class NarrowError(ValueError):
    """A compile nvcc cannot be narrowed to the variant's archs (none of its targets, or a target set by name)."""


def _codes(value: str) -> list[str]:
    return [c for c in re.split(r"[,\s]+", value.strip().strip("\"'").strip("[]")) if c]


def _gencode(value: str) -> tuple[str, list[str]]:
    """``arch=compute_80,code=[sm_80,compute_80]`` -> ``("compute_80", ["sm_80", "compute_80"])``."""
    text = value.strip().strip("\"'")
    arch, sep, code = text.partition(",code=")
    if not arch.startswith("arch=") or not sep:
        raise NarrowError(f"cannot read the nvcc target {value!r} (expected arch=compute_NN,code=...)")
    return arch.removeprefix("arch="), _codes(code)


def _from_arch(arch: str, code: str | None) -> tuple[str, list[str]]:
    """``-arch``/``-code`` as nvcc reads them: ``-arch=sm_80`` alone is SASS and PTX of compute_80."""
    match = _CODE_NAME.match(arch)
    if match is None:
        raise NarrowError(f"nvcc -arch={arch} names no single arch (all, all-major, native): cannot narrow it")
    virtual = f"compute_{match.group(2)}"
    if code is not None:
        return virtual, _codes(code)
    return virtual, [arch, virtual] if arch.startswith("sm_") else [virtual]


def _kept(code: str, sass: set[str], ptx: set[str]) -> bool:
    match = _CODE_NAME.match(code)
    if match is None:
        return False
    sm = f"sm_{match.group(2)}"
    return sm in (ptx if match.group(1) == "compute" else sass)


def _listed(codes: Sequence[str]) -> str:
    return "[" + ",".join(codes) + "]"


Target = tuple[str, list[str]]  # a -gencode entry: its virtual arch and its codes


def read_targets(args: Sequence[str]) -> tuple[list[Target], list[str]]:
    """The nvcc targets ``args`` name (``-gencode``, ``-arch``/``-code``), each as its virtual arch and codes, and
    the other arguments in order. Raise :class:`NarrowError` for a target it cannot read."""
    out: list[str] = []
    targets: list[Target] = []
    arch: str | None = None
    code: str | None = None
    index = 0
    while index < len(args):
        token = args[index]
        name, eq, value = token.partition("=")
        if name not in (*_GENCODE, *_ARCH, *_CODE) or (not eq and index + 1 >= len(args)):
            out.append(token)
            index += 1
            continue
        if not eq:
            value = args[index + 1]
        index += 1 if eq else 2
        if name in _GENCODE:
            targets.append(_gencode(value))
        elif name in _ARCH:
            arch = value
        else:
            code = value
    if arch is not None:
        targets.append(_from_arch(arch, code))
    elif code is not None:
        raise NarrowError(f"nvcc -code={code} without -arch: cannot narrow it")
    return targets, out


def gencode_flags(targets: Iterable[Target]) -> list[str]:
    """``-gencode`` flags for ``targets``, an entry with no code left out."""
    return [f for virtual, codes in targets if codes
            for f in ("-gencode", f"arch={virtual},code={codes[0] if len(codes) == 1 else _listed(codes)}")]


def narrow_args(args: Sequence[str], sass: Iterable[str], ptx: Iterable[str]) -> tuple[list[str], list[str]]:
    """``args`` with every nvcc target outside ``sass`` (``sm_90``) and ``ptx`` (``sm_90``: its compute_90 PTX)
    dropped, and the dropped codes; unchanged where ``args`` name no target (``nvcc -V``, a link).
    Raise :class:`NarrowError` when targets are named but none is kept."""
    sass, ptx = set(sass), set(ptx)
    targets, out = read_targets(args)
    if not targets:
        return list(args), []
    kept = [(virtual, [c for c in codes if _kept(c, sass, ptx)]) for virtual, codes in targets]
    dropped = sorted({c for _, codes in targets for c in codes if not _kept(c, sass, ptx)})
    flags = gencode_flags(kept)
    if not flags:
        asked = sorted({c for _, codes in targets for c in codes})
        wanted = sorted(sass) + [s.replace("sm_", "compute_") for s in sorted(ptx)]
        raise NarrowError(f"the build asks nvcc for {asked}, none of them the variant's {wanted}: nothing to"
                          " compile for it (change the variant's archs, or set arch_policy \"at_least\")")
    return flags + out, dropped


def front_command(python: str, real: Path, launcher: tuple[str, str] | None, cuobjdump: str | None,
                  narrow: tuple[Iterable[str], Iterable[str], Path] | None = None,
                  launched: Path | None = None) -> list[str]:
    """The command Kiln's nvcc runs before its arguments (:mod:`kiln.tasks.build.nvcc_split`): ``real`` nvcc, through
    ``launcher`` (the compile cache's executable and the variable its shims set below it) split per arch when
    ``cuobjdump`` is given, narrowed to ``narrow`` (the SASS archs, the PTX archs, the log) when given.
    ``launched``: run as CMake's CUDA compiler launcher, the compiler CMake found first among the arguments
    (``launched``, the nvcc shim standing for ``real``, or another compiler)."""
    command = [python, "-I", "-m", "kiln.tasks.build.nvcc_split", "--real", str(real.resolve())]
    if launched is not None:
        command += ["--launched", str(launched)]
    if narrow is not None:
        sass, ptx, log = narrow
        command += ["--sass", ",".join(sorted(sass)), "--ptx", ",".join(sorted(ptx)), "--log", str(log)]
    if launcher is not None:
        command += ["--launcher", launcher[0], "--active", launcher[1]]
        command += ["--cuobjdump", cuobjdump] if cuobjdump else []
    return [*command, "--"]


def narrowed_cuda_home(real: Path, where: Path, sass: Iterable[str], ptx: Iterable[str], python: str,
                       launcher: tuple[str, str] | None = None, cuobjdump: str | None = None) -> Path:
    """A CUDA home at ``where`` that is ``real`` but for ``bin/nvcc``: Kiln's nvcc, narrowing to ``sass``/``ptx``;
    ``launcher``: the compile cache's executable and the variable its shims set below it (a nested compile runs
    the real nvcc directly); ``cuobjdump``: split a compile per arch through it."""
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for item in real.iterdir():
        if item.name != "bin" and not (where / item.name).is_symlink():
            (where / item.name).symlink_to(item.resolve())
    for item in (real / "bin").iterdir():
        if item.name != "nvcc" and not (bin_dir / item.name).is_symlink():
            (bin_dir / item.name).symlink_to(item.resolve())
    command = front_command(python, real / "bin" / "nvcc", launcher, cuobjdump, (sass, ptx, where / LOG_NAME))
    shim = bin_dir / "nvcc"
    shim.write_text(f"#!/bin/sh\nexec {shlex.join(command)} \"$@\"\n")
    shim.chmod(0o755)
    return where


def narrowed(home: Path) -> list[dict[str, Any]]:
    """What the shim under ``home`` did, one entry per compile it changed (``dropped``, ``kept``) or refused
    (``refused``: why)."""
    log = home / LOG_NAME
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
