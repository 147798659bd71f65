"""``kiln init``'s reading of a torch extension written for the LibTorch stable ABI.

A package whose C++/CUDA sources register their ops through ``STABLE_TORCH_LIBRARY`` (the headers of
``torch/csrc/stable``) and never through ``TORCH_LIBRARY`` promises one wheel for every torch from a target on:
its variants get ``abi = "stable"`` (the wheel requires ``torch>=`` the target instead of pinning the torch it
built against; the build's audit refuses an unstable symbol) and ``torch_target``, the oldest torch it claims:

1. what its sources or build script say ``TORCH_TARGET_VERSION`` is (``TORCH_VERSION_2_13_0`` beside it, or the
   hex value ``0x020d000000000000``);
2. else the lower bound of the torch it requires (``torch>=2.13`` in pyproject.toml or setup.py);
3. else none: the build targets the torch it builds against (the config's default), and the file says so.

A package that registers through both macros is not stable-only: it keeps the exact mode, and the file says why.
Pure: sources in, text out; the written file is checked by Kiln's loader like the rest of ``kiln init``'s.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

_SUFFIXES = frozenset({".c", ".cc", ".cpp", ".cxx", ".cu", ".h", ".hh", ".hpp", ".cuh"})
_SKIP = frozenset({".git", ".venv", "venv", "build", "dist", ".kiln", "node_modules", "__pycache__", ".tox"})
_MAX_FILES = 2000  # a package's own sources; a vendored tree past this is not read further
_MAX_BYTES = 1 << 20

_STABLE = re.compile(r"\bSTABLE_TORCH_LIBRARY(?:_IMPL|_FRAGMENT)?\s*\(")
_UNSTABLE = re.compile(r"(?<![A-Z_])TORCH_LIBRARY(?:_IMPL|_FRAGMENT)?\s*\(")
_NAMED = re.compile(r"TORCH_TARGET_VERSION\s*(?:==|=)\s*TORCH_VERSION_(\d+)_(\d+)_\d+")
_HEX = re.compile(r"TORCH_TARGET_VERSION\s*=\s*0x([0-9a-fA-F]{2})([0-9a-fA-F]{2})[0-9a-fA-F]{12}\b")
_REQUIRES = re.compile(r"""["']torch\s*>=\s*(\d+)\.(\d+)""")


@dataclass(frozen=True)
class StableAbi:
    """What kiln init found: the stable mode (``stable``), its target, and why, one line each."""

    stable: bool
    target: str | None
    reasons: tuple[str, ...]


def _sources(root: Path) -> list[Path]:
    found: list[Path] = []
    for path in sorted(root.rglob("*")):
        if len(found) >= _MAX_FILES:
            break
        if _SKIP.intersection(path.relative_to(root).parts[:-1]) or path.suffix not in _SUFFIXES:
            continue
        if path.is_file() and path.stat().st_size <= _MAX_BYTES:
            found.append(path)
    return found


def _target(texts: dict[str, str], root: Path) -> tuple[str | None, str]:
    for name, text in texts.items():
        for pattern in (_NAMED, _HEX):
            match = pattern.search(text)
            if match:
                major, minor = (int(g, 16 if pattern is _HEX else 10) for g in match.groups())
                return f"{major}.{minor}", f"torch_target {major}.{minor}: {name} sets TORCH_TARGET_VERSION to it"
    for name in ("pyproject.toml", "setup.py", "setup.cfg"):
        path = root / name
        text = path.read_text(errors="replace") if path.is_file() else ""
        if name == "pyproject.toml" and text:
            deps = tomllib.loads(text).get("project", {}).get("dependencies", [])
            text = " ".join(f'"{d}"' for d in deps)
        match = _REQUIRES.search(text)
        if match:
            target = f"{match.group(1)}.{match.group(2)}"
            return target, f"torch_target {target}: {name} requires torch>={target}"
    return None, "no torch_target: nothing names one, so the build targets the torch it builds against"


def stable_abi(root: Path) -> StableAbi:
    """Whether the package at ``root`` is written for the LibTorch stable ABI only, and its target."""
    texts = {str(p.relative_to(root)): p.read_text(errors="replace") for p in _sources(root)}
    stable = sorted(name for name, text in texts.items() if _STABLE.search(text))
    if not stable:
        return StableAbi(False, None, ())
    unstable = sorted(name for name, text in texts.items() if _UNSTABLE.search(text))
    if unstable:
        verb = "registers" if len(unstable) == 1 else "register"
        return StableAbi(False, None, (f"abi exact: {', '.join(unstable[:3])} also {verb} ops through"
                                       " TORCH_LIBRARY (not the stable ABI), so its wheel pins the torch it built"
                                       " against",))
    setup_py = root / "setup.py"
    limited = setup_py.is_file() and "py_limited_api=True" in setup_py.read_text(errors="replace").replace(" ", "")
    texts |= {"setup.py": setup_py.read_text(errors="replace")} if setup_py.is_file() else {}
    target, why = _target(texts, root)
    also = " and builds with py_limited_api" if limited else ""
    verb = "registers" if len(stable) == 1 else "register"
    return StableAbi(True, target, (f"abi stable: {', '.join(stable[:3])} {verb} ops through"
                                    f" STABLE_TORCH_LIBRARY only{also}: one wheel for every torch from its target",
                                    why))


def with_stable_abi(text: str, root: Path) -> str:
    """``text`` (a rendered kiln.toml) with ``abi = "stable"`` and its ``torch_target`` on each variant, and the
    reasons in the header, when the package at ``root`` is written for the stable ABI; else ``text``."""
    found = stable_abi(root)
    if not found.reasons:
        return text
    lines, out = text.split("\n"), []
    header_done = in_variant = False
    for line in lines:
        if not header_done and not line.startswith("#"):  # after the header's last reason, before its advice
            header_done = True
        if not header_done and line.startswith("# Edit freely"):
            out += [f"#   - {reason}" for reason in found.reasons]
            header_done = True
        out.append(line)
        if line.startswith("["):
            in_variant = line.strip() == "[[variants]]"
        elif in_variant and found.stable and line.startswith("name = "):
            out.append('abi = "stable"                    # the LibTorch stable ABI only: requires torch>= its target')
            if found.target is not None:
                out.append(f'torch_target = "{found.target}"')
            in_variant = False
    return "\n".join(out)
