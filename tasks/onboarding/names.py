"""Where a package keeps its names and version, read as the ecosystem reads them (pure: reads files only).

The distribution's name, version and ``requires-python`` come from, in order:
``pyproject.toml``'s ``[project]``, ``setup.cfg``'s ``[metadata]``/``[options]``,
the ``setup(...)`` call of ``setup.py`` (a literal, or a module-level constant
it names: read from the syntax tree, never run), and an sdist's ``PKG-INFO``.
An extension module's name (``CUDAExtension(name=...)``) is never one of them.
"""

from __future__ import annotations

import ast
import configparser
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

# kiln.toml's key -> (setup.cfg section and key, setup() keyword, PKG-INFO field)
_FIELDS = {"name": ("metadata", "name", "name", "Name"),
           "version": ("metadata", "version", "version", "Version"),
           "requires-python": ("options", "python_requires", "python_requires", "Requires-Python")}


@dataclass(frozen=True)
class Declared:
    """A field's value and where the package declares it (``"setup.py setup(name=...)"``)."""

    value: str
    where: str


def setup_cfg(root: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(root / "setup.cfg", encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        pass  # an unreadable setup.cfg says nothing kiln init needs; the build reports it
    return parser


def parse_setup_py(text: str) -> ast.Module | None:
    try:
        return ast.parse(text) if text else None
    except (SyntaxError, ValueError):
        return None  # the build reports it; kiln init falls back to the other sources


def module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments (the last one wins, as when the module runs)."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found |= {t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)}
    return found


def _is_setup(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "setup") or (
        isinstance(func, ast.Attribute) and func.attr == "setup")


def setup_keywords(tree: ast.Module | None) -> dict[str, ast.expr]:
    """The keywords of the ``setup(...)`` call (the first one, wherever it is)."""
    if tree is None:
        return {}
    call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_setup(n)), None)
    return {k.arg: k.value for k in call.keywords if k.arg} if call is not None else {}


def literal(tree: ast.Module | None, node: ast.expr | None) -> Any:
    """``node`` as a Python literal, a name resolved through module-level string constants; None if neither."""
    if tree is None or node is None:
        return None
    if isinstance(node, ast.Name):
        return module_constants(tree).get(node.id)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _pkg_info(root: Path) -> dict[str, str]:
    path = root / "PKG-INFO"
    if not path.is_file():
        return {}
    message = Parser().parsestr(path.read_text(encoding="utf-8", errors="replace"), headersonly=True)
    return {k: str(v) for k, v in message.items()}


def _static(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip()) and not value.startswith(("attr:", "file:"))


def declarations(root: Path, pyproject: dict[str, Any], setup_py: str) -> dict[str, list[Declared]]:
    """Every static declaration of name, version and requires-python, and where, in the order kiln init reads
    them (pyproject.toml, setup.cfg, setup.py, PKG-INFO): the first is the one taken; where names disagree,
    the package does not say which one it means."""
    project = pyproject.get("project", {})
    cfg = setup_cfg(root)
    tree = parse_setup_py(setup_py)
    keywords = setup_keywords(tree)
    info = _pkg_info(root)
    found: dict[str, list[Declared]] = {}
    for key, (section, cfg_key, keyword, info_key) in _FIELDS.items():
        candidates = ((project.get(key), f"pyproject.toml [project] {key}"),
                      (cfg.get(section, cfg_key, fallback=None), f"setup.cfg [{section}] {cfg_key}"),
                      (literal(tree, keywords.get(keyword)), f"setup.py setup({keyword}=...)"),
                      (info.get(info_key), f"PKG-INFO {info_key}:"))
        found[key] = [Declared(v.strip(), w) for v, w in candidates if isinstance(v, str) and _static(v)]
    return found


def _find_call(tree: ast.Module | None) -> dict[str, Any]:
    """The literal keywords of ``setup(packages=find_packages(...))`` or ``find_namespace_packages(...)``, or the
    first such call anywhere in ``setup.py`` (often assigned to a constant first)."""
    if tree is None:
        return {}
    node = setup_keywords(tree).get("packages")
    calls = [node] if isinstance(node, ast.Call) else []
    calls += [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    for call in calls:
        func = call.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in ("find_packages", "find_namespace_packages"):
            found = {k.arg: literal(tree, k.value) for k in call.keywords if k.arg}
            if call.args:
                found.setdefault("where", literal(tree, call.args[0]))
            return found
    return {}


def _cfg_list(value: str) -> list[str]:
    return [v.strip() for v in value.replace(",", "\n").splitlines() if v.strip()]


def package_bases(root: Path, pyproject: dict[str, Any], setup_py: str) -> list[tuple[Path, str]]:
    """The folders the build config says hold the import packages (``package_dir``, ``packages.find where``),
    then ``src/`` and the root: (folder, what says so)."""
    setuptools = pyproject.get("tool", {}).get("setuptools", {})
    declared: list[tuple[object, str]] = []
    find = setuptools.get("packages", {})
    if isinstance(find, dict):
        for where in find.get("find", {}).get("where", []):
            declared.append((where, "[tool.setuptools.packages.find] where"))
    declared.append((setuptools.get("package-dir", {}).get(""), "[tool.setuptools] package-dir"))
    cfg = setup_cfg(root)
    cfg_dir = cfg.get("options", "package_dir", fallback="")
    declared.append((cfg_dir.split("=", 1)[1].strip() if cfg_dir.strip().startswith("=") else None,
                     "setup.cfg [options] package_dir"))
    declared += [(w, "setup.cfg [options.packages.find] where")
                 for w in _cfg_list(cfg.get("options.packages.find", "where", fallback=""))]
    tree = parse_setup_py(setup_py)
    package_dir = literal(tree, setup_keywords(tree).get("package_dir"))
    declared.append((package_dir.get("") if isinstance(package_dir, dict) else None, "setup.py package_dir"))
    declared.append((_find_call(tree).get("where"), "setup.py find_packages(where=...)"))
    bases = [(root / d, f"{why} = {d!r}") for d, why in declared if isinstance(d, str) and d.strip(". /")]
    return [(b, why) for b, why in bases if b.resolve().is_relative_to(root)] + [
        (root / "src", "src layout"), (root, "flat layout")]


def declared_packages(root: Path, pyproject: dict[str, Any], setup_py: str) -> tuple[str, ...]:
    """The import packages the build config names: ``packages=`` lists (dotted names) and the ``include``
    patterns of ``packages.find`` (``"org.pkg*"``), in pyproject.toml, setup.cfg and setup.py; empty when it
    names none (the build then discovers them)."""
    packages = pyproject.get("tool", {}).get("setuptools", {}).get("packages")
    names: list[object] = list(packages) if isinstance(packages, list) else []
    if isinstance(packages, dict):
        names += packages.get("find", {}).get("include", [])
    cfg = setup_cfg(root)
    listed = cfg.get("options", "packages", fallback="")
    if not listed.strip().startswith("find"):
        names += _cfg_list(listed)
    names += _cfg_list(cfg.get("options.packages.find", "include", fallback=""))
    tree = parse_setup_py(setup_py)
    in_setup = literal(tree, setup_keywords(tree).get("packages"))
    names += in_setup if isinstance(in_setup, list | tuple) else []
    include = _find_call(tree).get("include")
    names += include if isinstance(include, list | tuple) else []
    return tuple(dict.fromkeys(n.strip() for n in names if isinstance(n, str) and n.strip()))
