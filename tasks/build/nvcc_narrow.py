"""``arch_policy = "narrow"``: a ``pep517`` build that hard-codes its own ``-gencode`` list gets the variant's archs.

Many CUDA extension packages (flash-attention and the packages that copy its ``setup.py``: causal-conv1d,
mamba-ssm, ...) ignore ``TORCH_CUDA_ARCH_LIST`` and pass nvcc a fixed list of targets, nine archs for
causal-conv1d. Under ``narrow`` the build sees a CUDA home of its own (:func:`narrowed_cuda_home`: links to the
real toolkit, but ``bin/nvcc`` is this file run as a script) whose nvcc drops every target outside the
variant's archs before it runs the real nvcc, and says what it dropped (on stderr and in a log the unit reads).
Given the build's compile cache (``launcher``: ccache), it runs the real nvcc through it with the narrowed flags:
the narrowing runs on every compile, a hit included, so its record is whole and the cache keys the flags nvcc ran.
A compile whose targets are none of the variant's archs is refused, never compiled for something else; the
wheel is then checked as under ``exact``: it holds exactly what Kiln compiled for the archs it records.

This file runs as the build's nvcc with the standard library only (``python -I``): it imports nothing of Kiln.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
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


def narrow_args(args: Sequence[str], sass: Iterable[str], ptx: Iterable[str]) -> tuple[list[str], list[str]]:
    """``args`` with every nvcc target outside ``sass`` (``sm_90``) and ``ptx`` (``sm_90``: its compute_90 PTX)
    dropped, and the dropped codes; unchanged where ``args`` name no target (``nvcc -V``, a link).
    Raise :class:`NarrowError` when targets are named but none is kept."""
    sass, ptx = set(sass), set(ptx)
    out: list[str] = []
    targets: list[tuple[str, list[str]]] = []
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
    if not targets:
        return list(args), []
    kept = [(virtual, [c for c in codes if _kept(c, sass, ptx)]) for virtual, codes in targets]
    dropped = sorted({c for _, codes in targets for c in codes if not _kept(c, sass, ptx)})
    flags = [f for virtual, codes in kept if codes
             for f in ("-gencode", f"arch={virtual},code={codes[0] if len(codes) == 1 else _listed(codes)}")]
    if not flags:
        asked = sorted({c for _, codes in targets for c in codes})
        wanted = sorted(sass) + [s.replace("sm_", "compute_") for s in sorted(ptx)]
        raise NarrowError(f"the build asks nvcc for {asked}, none of them the variant's {wanted}: nothing to"
                          " compile for it (change the variant's archs, or set arch_policy \"at_least\")")
    return flags + out, dropped


def narrowed_cuda_home(real: Path, where: Path, sass: Iterable[str], ptx: Iterable[str], python: str,
                       launcher: tuple[str, str] | None = None) -> Path:
    """A CUDA home at ``where`` that is ``real`` but for ``bin/nvcc``: this file, narrowing to ``sass``/``ptx``;
    ``launcher``: the compile cache's executable and the variable its shims set below it (a nested compile runs
    the real nvcc directly)."""
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for item in real.iterdir():
        if item.name != "bin" and not (where / item.name).is_symlink():
            (where / item.name).symlink_to(item.resolve())
    for item in (real / "bin").iterdir():
        if item.name != "nvcc" and not (bin_dir / item.name).is_symlink():
            (bin_dir / item.name).symlink_to(item.resolve())
    command = [python, "-I", str(Path(__file__).resolve()), "--real", str((real / "bin" / "nvcc").resolve()),
               "--sass", ",".join(sorted(sass)), "--ptx", ",".join(sorted(ptx)), "--log", str(where / LOG_NAME),
               *(("--launcher", launcher[0], "--active", launcher[1]) if launcher else ()), "--"]
    shim = bin_dir / "nvcc"
    shim.write_text(f"#!/bin/sh\nexec {shlex.join(command)} \"$@\"\n")
    shim.chmod(0o755)
    return where


def narrowed(home: Path) -> list[dict[str, Any]]:
    """What the shim under ``home`` did, one entry per compile it changed (``dropped``, ``kept``) or refused
    (``refused``: why)."""
    log = home / LOG_NAME
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def _main(argv: list[str]) -> int:
    split = argv.index("--")
    options = dict(zip(argv[:split:2], argv[1:split:2], strict=True))
    args = argv[split + 1:]
    try:
        new, dropped = narrow_args(args, filter(None, options["--sass"].split(",")),
                                   filter(None, options["--ptx"].split(",")))
    except NarrowError as exc:
        print(f"kiln nvcc (arch_policy narrow): {exc}", file=sys.stderr)
        with open(options["--log"], "a", encoding="utf-8") as log:
            log.write(json.dumps({"refused": str(exc)}) + "\n")
        return 2
    if dropped:
        kept = [new[i + 1] for i, token in enumerate(new[:-1]) if token == "-gencode"]
        print(f"kiln nvcc (arch_policy narrow): dropped {dropped}, kept {kept}", file=sys.stderr)
        with open(options["--log"], "a", encoding="utf-8") as log:
            log.write(json.dumps({"dropped": dropped, "kept": kept}) + "\n")
    real, launcher, active = options["--real"], options.get("--launcher"), options.get("--active", "")
    if launcher and active and not os.environ.get(active):  # through the compile cache, once
        os.environ[active] = "1"
        os.execv(launcher, [launcher, real, *new])
    os.execv(real, [real, *new])
    return 127  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
