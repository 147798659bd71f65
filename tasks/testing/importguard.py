"""The import guard of a test or bench environment: the wheel imports only what it declares.

A suite's environment layers a shared base environment (torch, Triton, numpy,
pytest and what they need) after its own site-packages (:mod:`.baseenv`), so
more is importable there than the wheel declares — pytest's own dependency
``packaging``, say. This module is copied into the environment's
site-packages as ``_kiln_import_guard.py`` and installed at interpreter start
by a ``.pth`` line; it wraps ``builtins.__import__`` (which also sees imports
answered from ``sys.modules``, which a meta-path finder never does) and, for
an import made by the wheel's own modules, refuses a top-level module that
only a distribution outside the closure of the wheel's declared requirements
provides, raising ``ModuleNotFoundError`` that names the module and says the
wheel does not declare it. An import made by a test file (a file under the
project root) is held to the closure of the wheel, pytest and the suite's
``requires``. Everything else — the standard library, Kiln's harness, torch's
own imports — passes untouched.

The refusals are computed once, when the environment is made
(:func:`refusals`, run inside the environment), and read from
``_kiln_import_guard.json`` beside this file. Standard library only: it runs
before anything else in the environment's interpreter.
"""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any

CONFIG = "_kiln_import_guard.json"
MODULE = "_kiln_import_guard"
KILN_RUNTIME = "kiln.runtime"


class Guard:
    """Which top-level names the wheel's modules and the test files may not import, and why."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.packages: frozenset[str] = frozenset(config["packages"])
        self.wheel: str = config["wheel"]
        self.tests_root: str = config.get("tests_root") or ""
        self.for_package: dict[str, list[str]] = config["for_package"]
        self.for_tests: dict[str, list[str]] = config["for_tests"]
        self.watched = frozenset(self.for_package) | frozenset(self.for_tests)

    def refused(self, name: str, importer: dict[str, Any] | None) -> tuple[str, list[str]] | None:
        """(the module, the distributions that provide it) when ``importer`` may not import ``name``, else None."""
        top = watched_name(name)
        if top not in self.watched or not importer:
            return None
        name = str(importer.get("__name__") or "")
        rules = None
        if str(importer.get("__name__") or "").partition(".")[0] in self.packages:
            rules = self.for_package
        else:
            path = str(importer.get("__file__") or "")
            if self.tests_root and path.startswith(self.tests_root + os.sep) and "site-packages" not in path:
                rules = self.for_tests
        return (top, rules[top]) if rules is not None and top in rules else None

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


def install(directory: str | None = None) -> None:
    """Wrap ``builtins.__import__`` with the guard configured beside this file (no config: no guard)."""
    config_path = Path(directory or Path(__file__).parent) / CONFIG
    if not config_path.is_file():
        return
    guard = Guard(json.loads(config_path.read_text()))
    original = builtins.__import__

    def guarded(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0:
            refused = guard.refused(name, globals)
            if refused is not None:
                raise guard.error(refused[0], refused[1], globals)
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded


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

