"""Content hash of a kernel's source: its module and what it imports from the package;
and of a whole project that its own build backend builds (:func:`project_hash`).

Static (AST) and import-free, so planning a build never runs kernel code.
Only modules inside the project's package count: a change anywhere else
(torch, triton) is covered by the toolchain versions in the cache key.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from kiln.core.errors import CompileError, ConfigError
from kiln.tasks.project.registry import module_file

_GIT_TIMEOUT_S = 60
# Directories that are build outputs or tool state, never a project's source (used outside git only).
_NOT_SOURCE = {".git", ".kiln", ".venv", "build", "dist", "out", "__pycache__", ".tox", ".nox"}
_KILN_DIR = ".kiln"
_RUN_MANIFEST = "run.json"  # kiln.core.manifest.MANIFEST_NAME: a run's local view holds one


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


def _git(project_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    try:
        return subprocess.run(["git", "-C", str(project_dir), *args], capture_output=True, timeout=_GIT_TIMEOUT_S,
                              check=False)
    except FileNotFoundError:
        return None


def _names(done: subprocess.CompletedProcess[bytes] | None) -> list[str] | None:
    if done is None or done.returncode != 0:
        return None
    return [n for n in done.stdout.decode().split("\0") if n]


def _run_views(project_dir: Path, names: list[str]) -> set[str]:
    """Directories (relative) that are Kiln's ``--out``: the parents of run views (a dir holding Kiln's run.json)."""
    found = set()
    for name in names:
        if PurePosixPath(name).name != _RUN_MANIFEST:
            continue
        try:
            data = json.loads((project_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "run_id" in data and "units" in data:
            view = PurePosixPath(name).parent
            found.add(view.parent.as_posix() if view.parent != PurePosixPath(".") else view.as_posix())
    return found


def _kiln_state(names: list[str], project_dir: Path, exclude: Sequence[Path]) -> set[str]:
    """Which of ``names`` (untracked files) are Kiln's own state: ``.kiln/``, ``exclude`` (the build cache),
    and a ``--out`` directory; never a project's source, so never hashed nor copied (a rebuild of the same
    commit then hits the cache)."""
    outs = _run_views(project_dir, names)
    roots = [Path(os.path.abspath(d)) for d in exclude]
    state = set()
    for name in names:
        parts = PurePosixPath(name).parts
        path = Path(os.path.abspath(project_dir / name))
        if _KILN_DIR in parts[:-1] or any(path.is_relative_to(r) for r in roots) \
                or any(name.startswith(f"{o}/") for o in outs):
            state.add(name)
    return state


def project_files(project_dir: Path, exclude: Sequence[Path] = ()) -> list[str]:
    """The project's source files, relative to ``project_dir``, sorted: what is hashed is what is built.

    In git: the tracked files and the untracked ones git does not ignore, less Kiln's own state
    (:func:`_kiln_state`). Outside git: the whole tree less build outputs and tool state.
    """
    project_dir = Path(project_dir)
    tracked = _names(_git(project_dir, "ls-files", "-z", "--cached", "."))
    others = _names(_git(project_dir, "ls-files", "-z", "--others", "--exclude-standard", f"--exclude={_KILN_DIR}",
                         "."))
    if tracked is not None and others is not None:
        others = sorted(set(others) - _kiln_state(others, project_dir, exclude))
        return sorted(n for n in {*tracked, *others} if (project_dir / n).is_file())
    roots = [Path(os.path.abspath(d)) for d in exclude]
    found = []
    for dirpath, dirnames, filenames in os.walk(project_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_SOURCE and not d.endswith(".egg-info")
                             and not any(Path(os.path.abspath(Path(dirpath) / d)).is_relative_to(r) for r in roots))
        found += [(Path(dirpath) / f).relative_to(project_dir).as_posix() for f in filenames if not f.endswith(".pyc")]
    return sorted(found)


def head_commit(project_dir: Path) -> str:
    """The commit the project's checkout is at ("" outside git or before the first commit)."""
    done = _git(project_dir, "rev-parse", "--verify", "--quiet", "HEAD")
    return done.stdout.decode().strip() if done is not None and done.returncode == 0 else ""


def project_hash(project_dir: Path, exclude: Sequence[Path] = (), unhashed: Sequence[str] = ()) -> str:
    """Content hash of the project's files (names and bytes) and its commit: the backend unit's cache input.

    The commit counts because git-based tooling (setuptools-scm's version and file list) reads it.
    ``unhashed``: files (relative to ``project_dir``) left out, whose content the unit's key holds otherwise.
    """
    digest = hashlib.sha256(head_commit(project_dir).encode() + b"\0")
    for name in project_files(project_dir, exclude):
        if name in unhashed:
            continue
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((project_dir / name).read_bytes()).digest())
    return digest.hexdigest()


def copy_project(project_dir: Path, dest: Path, exclude: Sequence[Path] = ()) -> Path:
    """A private copy of the project as its own build sees it; returns the project's directory in it.

    In git: a clone of the repository at HEAD (``--shared``: objects are borrowed, not copied) with the
    working tree's changes under the project laid over it, so ``.git`` is there for the tooling that reads
    it (setuptools-scm's file list and version). Outside git: the files of :func:`project_files`.
    """
    project_dir = Path(project_dir)
    head = head_commit(project_dir)
    where = _git(project_dir, "rev-parse", "--show-toplevel", "--show-prefix")
    if not head or where is None or where.returncode != 0:
        for name in project_files(project_dir, exclude):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project_dir / name, dest / name)
        return dest
    top, prefix = (where.stdout.decode().splitlines() + [""])[:2]
    _checked(["git", "clone", "--quiet", "--shared", "--no-checkout", top, str(dest)], "cloning")
    _checked(["git", "-C", str(dest), "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", head],
             "checking out")
    source = dest / prefix
    changed = _names(_git(project_dir, "diff", "--name-only", "--no-renames", "--relative", "-z", "HEAD", "--", "."))
    others = _names(_git(project_dir, "ls-files", "-z", "--others", "--exclude-standard", f"--exclude={_KILN_DIR}",
                         ".")) or []
    others = sorted(set(others) - _kiln_state(others, project_dir, exclude))
    for name in sorted({*(changed or []), *others}):
        target = source / name
        if (project_dir / name).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project_dir / name, target)
        elif target.is_file() or target.is_symlink():
            target.unlink()  # deleted in the working tree
    return source


def _checked(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        raise CompileError(f"{what} the project for its build failed: {exc}") from exc
    if done.returncode != 0:
        raise CompileError(f"{what} the project for its build failed ({' '.join(cmd)}):\n{done.stderr[-1500:]}")
