"""The import guard of a test or bench environment: the wheel imports only what it declares.

A suite's environment layers a shared base environment (torch, Triton, numpy,
pytest and what they need) after its own site-packages (:mod:`.baseenv`), so
more is importable there than the wheel declares — pytest's own dependency
``packaging``, say. This module is copied into the environment's
site-packages as ``_kiln_import_guard.py`` and installed at interpreter start
by a ``.pth`` line. For an import made by the wheel's own modules it refuses
a top-level module that only a distribution outside the closure of the
wheel's declared requirements provides, raising ``ModuleNotFoundError`` that
names the module and says the wheel does not declare it; an import made by
test code is held to the closure of the wheel, pytest and the suite's
``requires``. Everything else — the standard library, Kiln's harness, torch's
own imports — passes untouched.

Who imports is decided from what the environment holds, never from where a
file happens to lie (:meth:`Guard.role`):

- the **package's code**: a module whose top-level name is one the wheel
  installs (its RECORD, read when the environment is made);
- **Kiln's own code** — every ``kiln.*`` module except ``kiln.runtime`` (the
  ``kiln-runtime`` wheel's), and anything whose file lies in the environment
  or its shared base (installed code): neither, whatever the directory Kiln
  was installed or checked out to (an editable Kiln inside the project under
  test included). A test importing ``kiln.tasks...`` is judged like one
  importing pytest;
- **test code**: a file under one of the suite's test paths, or a
  ``conftest.py`` / ``__init__.py`` in a directory between the project root
  and one of them (what pytest loads for the suite).

Three hooks, because no single one sees every import:

- a **meta-path finder** (first on ``sys.meta_path``) sees every import that
  loads a module, however it is made — an ``import`` statement,
  ``importlib.import_module``, ``__import__``, ``importlib.util.find_spec`` —
  and finds the importer by walking the stack past importlib's own frames;
- but a finder is never asked about a module already in ``sys.modules`` (the
  test file imported ``packaging`` first, then the package's lazy import of
  it is answered from there), so ``builtins.__import__`` is wrapped for
  ``import`` statements, and ``importlib.import_module`` for calls of it.

Whoever imports on another's behalf is passed over on the way out: importlib's
frames, the standard library's helpers that take a dotted name
(``pkgutil.resolve_name``, ``unittest.mock.patch``, ``pydoc.locate``), and code run with globals
that name no module (``exec(code, {})``) — the import is judged as the code's
that called them.

The refusals are computed once, when the environment is made
(:data:`REFUSALS_SCRIPT`, run inside the environment), and read from
``_kiln_import_guard.json`` beside this file. Standard library only: it runs
before anything else in the environment's interpreter.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Literal

CONFIG = "_kiln_import_guard.json"
MODULE = "_kiln_import_guard"
KILN_RUNTIME = "kiln.runtime"
Role = Literal["package", "tests"]
# Frames of these files are the import machinery, not the importer.
_MACHINERY = (os.path.dirname(importlib.__file__ or "") + os.sep, "<frozen importlib")
_STDLIB = os.path.dirname(os.__file__)
# The standard library's helpers that import a name on their caller's behalf (``pkgutil.resolve_name``,
# ``unittest.mock.patch`` by way of it, ``pydoc.locate``): their frames are passed over like importlib's, so the
# import is judged as the caller's. Their paths, not their modules: importing them here would slow every start.
_ON_BEHALF = frozenset(os.path.join(_STDLIB, *parts) for parts in (("pkgutil.py",), ("pydoc.py",),
                                                                           ("unittest", "mock.py")))


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _conftest_dirs(tests_root: str, test_paths: tuple[str, ...]) -> frozenset[str]:
    """The directories from the project root down to each test path: pytest loads their conftest.py."""
    dirs = set()
    for path in test_paths:
        here = os.path.dirname(path)
        while _under(here, (tests_root,)):
            dirs.add(here)
            parent = os.path.dirname(here)
            if parent == here:
                break
            here = parent
    return frozenset(dirs)


class Guard:
    """Which top-level names the wheel's modules and the test code may not import, and why."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.packages: frozenset[str] = frozenset(config["packages"])
        self.wheel: str = config["wheel"]
        self.for_package: dict[str, list[str]] = config["for_package"]
        self.for_tests: dict[str, list[str]] = config["for_tests"]
        self.watched = frozenset(self.for_package) | frozenset(self.for_tests)
        tests_root = config.get("tests_root") or ""
        self.test_paths: tuple[str, ...] = tuple(config.get("test_paths") or ([tests_root] if tests_root else []))
        self.conftest_dirs = _conftest_dirs(tests_root, self.test_paths) if tests_root else frozenset()
        self.installed: tuple[str, ...] = tuple(config.get("installed") or ())

    def role(self, importer: dict[str, Any]) -> Role | None:
        """Whether ``importer`` (a module's globals) is the package's code, test code, or neither (None)."""
        name = str(importer.get("__name__") or "")
        top = name.partition(".")[0]
        if top in self.packages:
            return "package"
        if top == "kiln" and watched_name(name) != KILN_RUNTIME:
            return None  # Kiln's own harness, wherever Kiln was installed from
        file = importer.get("__file__")
        if not isinstance(file, str) or not file:
            return None
        path = os.path.abspath(file)
        real = os.path.realpath(path)
        if _under(path, self.installed) or _under(real, self.installed):
            return None
        if _under(real, self.test_paths) or _under(path, self.test_paths):
            return "tests"
        here, base = os.path.split(real)
        return "tests" if base in ("conftest.py", "__init__.py") and here in self.conftest_dirs else None

    def refused(self, name: str, importer: dict[str, Any] | None) -> tuple[str, list[str]] | None:
        """(the module, the distributions that provide it) when ``importer`` may not import ``name``, else None."""
        top = watched_name(name)
        if top not in self.watched or not importer:
            return None
        role = self.role(importer)
        rules = self.for_package if role == "package" else self.for_tests if role == "tests" else None
        return (top, rules[top]) if rules is not None and top in rules else None

    def check(self, name: str, importer: dict[str, Any] | None) -> None:
        """Raise the guard's ``ModuleNotFoundError`` when ``importer`` may not import ``name``."""
        refused = self.refused(name, importer)
        if refused is not None and importer is not None:
            raise self.error(refused[0], refused[1], importer)

    def error(self, top: str, dists: list[str], importer: dict[str, Any]) -> ModuleNotFoundError:
        who = str(importer.get("__name__") or importer.get("__file__") or "?")
        return ModuleNotFoundError(
            f"No module named {top!r}: {who} imports it, but the wheel {self.wheel} does not declare a dependency"
            f" that provides it ({', '.join(dists)}), so a user's pip install would not install it; add it to the"
            f" package's dependencies (a test file's import: to the suite's requires)", name=top)


def watched_name(name: str) -> str:
    """The name the rules know ``name`` by: its top-level module; ``kiln.runtime`` for the kiln-runtime wheel's.

    ``kiln`` is a namespace: Kiln's harness (``kiln.tasks``...) is always allowed, ``kiln.runtime`` is what
    the ``kiln-runtime`` distribution provides, so it is held to the rules under that name.
    """
    top = name.partition(".")[0]
    if top != "kiln":
        return top
    return KILN_RUNTIME if (name + ".").startswith(KILN_RUNTIME + ".") else ""


def anonymous(importer: dict[str, Any]) -> bool:
    """Whether ``importer`` is globals that name no module: ``exec(code, {})``'s fresh dict, say.

    Such code imports on behalf of whoever ran it (``exec`` fills in only ``__builtins__``), so the
    importer is found further out on the stack, never judged "neither" for want of a name.
    """
    if isinstance(importer.get("__file__"), str) and importer["__file__"]:
        return False
    module = sys.modules.get(str(importer.get("__name__") or ""))
    return getattr(module, "__dict__", None) is not importer


def importer_globals(frame: FrameType | None) -> dict[str, Any] | None:
    """The globals of the first frame from ``frame`` outwards that is the importer.

    Passed over: this guard, importlib's machinery, the standard library's import-on-behalf helpers
    and code run with anonymous globals (:func:`anonymous`).
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if (filename != __file__ and not filename.startswith(_MACHINERY) and filename not in _ON_BEHALF
                and not anonymous(frame.f_globals)):
            return frame.f_globals
        frame = frame.f_back
    return None


class GuardFinder:
    """A meta-path finder that finds nothing: it refuses, before any finder looks, what the importer may not load."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    # Any: as importlib's MetaPathFinder.find_spec takes them
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if watched_name(name) in self.guard.watched:
            self.guard.check(name, importer_globals(sys._getframe(1)))
        return None


def install(directory: str | None = None) -> None:
    """Install the guard configured beside this file (no config: no guard): the finder and both wrappers."""
    config_path = Path(directory or Path(__file__).parent) / CONFIG
    if not config_path.is_file():
        return
    guard = Guard(json.loads(config_path.read_text()))
    sys.meta_path.insert(0, GuardFinder(guard))
    original_import = builtins.__import__
    original_import_module = importlib.import_module

    # Any: as builtins.__import__ takes them
    def guarded(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and watched_name(name) in guard.watched:  # __import__("x") called with no globals: the caller
            named = globals is not None and not anonymous(globals)
            guard.check(name, globals if named else importer_globals(sys._getframe(1)))
        return original_import(name, globals, locals, fromlist, level)

    def import_module(name: str, package: str | None = None) -> Any:
        if not name.startswith(".") and watched_name(name) in guard.watched:
            guard.check(name, importer_globals(sys._getframe(1)))
        return original_import_module(name, package)

    builtins.__import__ = guarded
    importlib.import_module = import_module


# Run inside the environment when it is made (needs ``packaging``, which the base holds):
# argv[1] = JSON {"wheel_dist": name, "extra_roots": [requirement, ...] for the tests}.
REFUSALS_SCRIPT = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

args = json.loads(sys.argv[1])
dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}

def closure(roots):
    seen, todo = set(), [(canonicalize_name(Requirement(r).name), Requirement(r).extras) for r in roots]
    while todo:
        name, extras = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        for text in dists[name].requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((canonicalize_name(req.name), req.extras))
    return seen

tops = {}
for top, names in metadata.packages_distributions().items():
    if top in sys.stdlib_module_names or top.startswith("_kiln_import_guard"):
        continue
    tops[top] = sorted({canonicalize_name(n) for n in names})
if "kiln" in tops:  # a namespace: only kiln.runtime is a distribution's (Kiln's harness is exposed apart)
    tops["kiln.runtime"] = tops.pop("kiln")
package = closure([args["wheel_dist"]])
tests = closure([args["wheel_dist"], *args["extra_roots"]])
refuse = lambda allowed: {t: n for t, n in tops.items() if not set(n) & allowed}
tops_of_wheel = sorted(t for t, n in tops.items() if canonicalize_name(args["wheel_dist"]) in n)
print(json.dumps({"packages": tops_of_wheel, "for_package": refuse(package), "for_tests": refuse(tests)}))
"""

