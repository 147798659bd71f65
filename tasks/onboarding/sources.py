"""The native sources a package's build names and its tree lacks (pure: reads files, runs nothing).

An sdist whose ``MANIFEST.in`` left its ``csrc/`` out still carries a ``setup.py`` that names those files: every
build of it fails (or, where the build skips a missing extension, ships no library). ``kiln init`` says so
before it promises a nightly. Only ``folder/name`` paths count (a bare name may be one the build excludes), and
one counts as shipped where some file of the tree ends with it; a glob pattern is skipped (a build globs each
vendor's sources and takes what is there). Never a false alarm before a missed one: init exits 1 on it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

_NATIVE = re.compile(r"\.(c|cc|cpp|cxx|cu|cuh|hip|mm)$")
_SKIP = {".git", "build", "dist", "__pycache__", ".venv", "node_modules"}


def _named(setup_tree: ast.Module | None, pyproject: dict[str, Any]) -> list[str]:
    """The native source paths ``setup.py`` (any string literal) and ``[tool.setuptools] ext-modules`` name."""
    names = [n.value for n in ast.walk(setup_tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             ] if setup_tree is not None else []
    for ext in pyproject.get("tool", {}).get("setuptools", {}).get("ext-modules", []) or []:
        names += [s for s in ext.get("sources", []) if isinstance(s, str)] if isinstance(ext, dict) else []
    paths = [n.strip().removeprefix("./") for n in names if "\n" not in n and len(n) < 300]
    return [p for p in paths if _NATIVE.search(p) and not p.startswith(("-", "/", "."))]  # ".cu": a suffix test


def _tree(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and not _SKIP.intersection(p.relative_to(root).parts)]


def missing_sources(root: Path, setup_tree: ast.Module | None, pyproject: dict[str, Any]) -> tuple[str, ...]:
    """Each native source the build names that no file of ``root`` is (sorted, once each)."""
    named = _named(setup_tree, pyproject)
    if not named:
        return ()
    files = _tree(root)

    def shipped(path: str) -> bool:
        return any(f == path or f.endswith(f"/{path}") for f in files)

    # Only a folder/name path is a named source: a bare name may be one the build excludes or removes (xformers'
    # exclude_files), a fragment it joins ("_cuda.cu"); a glob that matches nothing is a vendor's absent sources.
    return tuple(sorted({p for p in named if "/" in p and not any(c in p for c in "*?[") and not shipped(p)}))
