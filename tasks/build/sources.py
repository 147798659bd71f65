"""Content hash of a kernel's source: its module and what it imports from the package;
and of a whole project that its own build backend builds (:func:`project_hash`).

Static (AST) and import-free, so planning a build never runs kernel code.
Only modules inside the project's package count: a change anywhere else
(torch, triton) is covered by the toolchain versions in the cache key.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kiln.release.errors import ConfigError

_GIT_TIMEOUT_S = 60
# Directories that are build outputs or tool state, never a project's source (used outside git only).
_NOT_SOURCE = {".git", ".kiln", ".venv", "build", "dist", "out", "__pycache__", ".tox", ".nox"}


def module_file(package_dir: Path, package: str, module: str) -> Path | None:
    """The file of ``module`` (``package.sub`` -> ``<package_dir>/sub.py`` or ``sub/__init__.py``),
    or None when it is not a module of ``package`` or has no file there."""
    if module != package and not module.startswith(package + "."):
        return None
    parts = module.split(".")[1:]
    base = package_dir.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_level(tree: ast.AST) -> Iterator[ast.AST]:
    """Nodes outside function bodies: a lazy import inside a function is a
    run-time path (a loader, a fallback), not part of what gets compiled."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in _module_level(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            # `from pkg import sub` may name a submodule.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def source_closure(package_dir: Path, package: str, module: str) -> list[Path]:
    """Files of ``module`` and of every package module it imports, transitively."""
    start = module_file(package_dir, package, module)
    if start is None:
        raise ConfigError(f"kernel module {module!r} is not a module of package {package!r} under {package_dir}")
    seen: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = module_file(package_dir, package, name)
        if path is None or name in seen:
            continue
        seen[name] = path
        # A package __init__'s bytes count, but not what it imports: one that
        # re-exports every kernel would make each kernel's key depend on all.
        if path.name != "__init__.py" or name == module:
            tree = ast.parse(path.read_bytes(), filename=str(path))
            pending.extend(_imports(tree, name, path.name == "__init__.py"))
    # Importing a.b.c runs a/__init__.py too.
    for name in list(seen):
        for i in range(1, name.count(".") + 1):
            parent = module_file(package_dir, package, ".".join(name.split(".")[:i]))
            if parent is not None:
                seen.setdefault(".".join(name.split(".")[:i]), parent)
    return sorted(set(seen.values()))


def source_hash(package_dir: Path, package: str, module: str) -> str:
    digest = hashlib.sha256()
    for path in source_closure(package_dir, package, module):
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def project_files(project_dir: Path) -> list[str]:
    """The project's source files, relative to ``project_dir``, sorted: what is hashed is what is built."""
    try:
        done = subprocess.run(["git", "-C", str(project_dir), "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard", "."], capture_output=True, timeout=_GIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        done = None
    if done is not None and done.returncode == 0:
        names = done.stdout.decode().split("\0")
        return sorted(n for n in names if n and (project_dir / n).is_file())
    found = []
    for dirpath, dirnames, filenames in os.walk(project_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_SOURCE and not d.endswith(".egg-info"))
        found += [(Path(dirpath) / f).relative_to(project_dir).as_posix() for f in filenames if not f.endswith(".pyc")]
    return sorted(found)


def project_hash(project_dir: Path) -> str:
    """Content hash of the project's files (names and bytes): the backend unit's cache input."""
    digest = hashlib.sha256()
    for name in project_files(project_dir):
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((project_dir / name).read_bytes()).digest())
    return digest.hexdigest()
