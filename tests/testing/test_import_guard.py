"""The import guard: who imports is decided from what the environment holds, and no route of import escapes it.

The rules are a pure function of the guard's configuration (:class:`Guard`, a
table of importers); the routes are checked in a real environment (uv, the
shared base of ``$KILN_TEST_ENV_CACHE``) through Kiln's worker, no mocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.testing import envs
from kiln.tasks.testing.importguard import Guard
from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.runner import run_tests
from tests.helpers.wheelkit import make_wheel

PROJECT = "/src/project"
ENV = "/src/project/out/tests/.envs/cpu"  # an environment made inside the project, as `kiln nightly --out out` does
BASE = "/cache/bases/c001ef3b"
CONFIG = {
    "packages": ["probe_pkg"], "wheel": "probe_pkg-1.0-py3-none-any.whl",
    "for_package": {"pydantic": ["pydantic"], "numpy": ["numpy"], "packaging": ["packaging"],
                    "kiln.runtime": ["kiln-runtime"]},
    "for_tests": {"pydantic": ["pydantic"], "numpy": ["numpy"], "kiln.runtime": ["kiln-runtime"]},
    "tests_root": PROJECT, "test_paths": [f"{PROJECT}/tests/kernels"], "installed": [ENV, BASE],
}


@pytest.mark.parametrize(("name", "file", "role"), [
    ("probe_pkg.ops", f"{ENV}/lib/python3.11/site-packages/probe_pkg/ops.py", "package"),
    ("tests.kernels.test_ops", f"{PROJECT}/tests/kernels/test_ops.py", "tests"),
    ("tests.kernels.conftest", f"{PROJECT}/tests/kernels/conftest.py", "tests"),
    ("tests.conftest", f"{PROJECT}/tests/conftest.py", "tests"),  # pytest loads it for the suite
    ("tests.helpers", f"{PROJECT}/tests/helpers.py", None),  # above the suite's paths, not a conftest
    # Kiln itself, installed editable from the project's own checkout: not the project's test code.
    ("kiln.tasks.bench.results", f"{PROJECT}/tasks/bench/results.py", None),
    ("kiln.tasks.bench.results", f"{ENV}/kiln-harness/kiln/tasks/bench/results.py", None),
    ("__main__", f"{ENV}/kiln-harness/kiln/tasks/testing/pytest_server.py", None),  # `python -m` of the harness
    ("torch.nn", f"{BASE}/lib/python3.11/site-packages/torch/nn/__init__.py", None),
    ("kiln.runtime.loader", f"{ENV}/lib/python3.11/site-packages/kiln/runtime/loader.py", None),
])
def test_the_importers_role_comes_from_the_wheels_names_the_suites_paths_and_the_environment(name, file, role):
    assert Guard(CONFIG).role({"__name__": name, "__file__": file}) == role


@pytest.mark.parametrize(("name", "importer", "refused"), [
    ("packaging.version", "probe_pkg", "packaging"),  # the package's undeclared import
    ("packaging.version", "tests.kernels.test_ops", None),  # a test may: pytest declares packaging
    ("numpy", "tests.kernels.test_ops", "numpy"),  # a test may not: nothing it declares provides numpy
    ("kiln.runtime.spec", "probe_pkg", "kiln.runtime"),  # kiln-runtime is held to the rules
    ("kiln.tasks.bench.results", "tests.kernels.test_ops", None),  # Kiln's harness: like pytest
    ("pydantic", "kiln.tasks.bench.results", None),  # and what Kiln imports is Kiln's business
])
def test_every_refusal_for_the_package_and_its_tests_is_kept(name, importer, refused):
    files = {"probe_pkg": f"{ENV}/lib/python3.11/site-packages/probe_pkg/__init__.py",
             "tests.kernels.test_ops": f"{PROJECT}/tests/kernels/test_ops.py",
             "kiln.tasks.bench.results": f"{PROJECT}/tasks/bench/results.py"}
    found = Guard(CONFIG).refused(name, {"__name__": importer, "__file__": files[importer]})
    assert (found[0] if found else None) == refused


PROBE_BODY = '''
import importlib


def by_statement():
    import packaging.version  # not in the wheel's Requires-Dist: pytest's dependency, not the package's
    return packaging.version


def by_import_module(name):
    return importlib.import_module(name)
'''

PROBE_TESTS = '''
import importlib

import packaging.version  # a test file may: pytest declares packaging; now it is in sys.modules

import probe_pkg


def test_statement():
    probe_pkg.by_statement()


def test_import_module_of_a_module_not_yet_imported():
    probe_pkg.by_import_module("numpy")


def test_import_module_of_a_module_already_imported():
    probe_pkg.by_import_module("packaging.version")


def test_import_module_by_the_test_itself():
    importlib.import_module("numpy")


def test_kilns_own_modules_import_what_kiln_needs():
    import kiln.tasks.bench.results  # imports pydantic, which neither the wheel nor the suite declares
    assert kiln.tasks.bench.results.BenchResults
'''


@pytest.mark.slow
def test_every_route_of_import_is_refused_and_kilns_own_modules_are_not_test_code(tmp_path):
    # The README's set-up: the run's environment lies inside the project (`kiln nightly --out out`).
    project = tmp_path / "project"
    (project / "tests" / "kernels").mkdir(parents=True)
    (project / "tests" / "kernels" / "test_probe.py").write_text(PROBE_TESTS)
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg", body=PROBE_BODY)
    env = envs.make_env(project / "out" / "tests" / ".envs" / "cpu", [wheel], tests_root=project,
                        test_paths=["tests/kernels"])

    results = run_tests(["tests/kernels"], project, project / "out" / "work",
                        RunOptions(python=str(env.python), preload=(), gpus=0, retries=0))

    by_name = {r.nodeid.rpartition("::")[2]: r for r in results}
    assert {n: r.outcome for n, r in by_name.items()} == {
        "test_statement": "error", "test_import_module_of_a_module_not_yet_imported": "error",
        "test_import_module_of_a_module_already_imported": "error", "test_import_module_by_the_test_itself": "error",
        "test_kilns_own_modules_import_what_kiln_needs": "passed"}, [(r.nodeid, r.details[-800:]) for r in results]
    for name, module, who in [("test_statement", "packaging", "probe_pkg"),
                              ("test_import_module_of_a_module_not_yet_imported", "numpy", "probe_pkg"),
                              ("test_import_module_of_a_module_already_imported", "packaging", "probe_pkg"),
                              ("test_import_module_by_the_test_itself", "numpy", "test_probe")]:
        message = by_name[name].message
        assert f"No module named {module!r}: " in message and "does not declare" in message, message
        assert who in message or who in by_name[name].details, message
    assert Path(env.root).is_relative_to(project)


HELPERS_BODY = '''
import pkgutil
import pydoc
from unittest import mock


def by_resolve_name():
    return pkgutil.resolve_name("undeclared.sub:VALUE")  # imports undeclared.sub on the package's behalf


def by_pydoc_locate():
    # pydoc's safeimport calls __import__ on the package's behalf, and answers a refused first import with None
    if pydoc.locate("undeclared.sub.VALUE") is None:
        raise ModuleNotFoundError("pydoc.locate found nothing")


def by_exec_in_fresh_globals():
    exec("import undeclared.sub", {})  # exec fills in __builtins__ only: the globals name no module


def by_mock_patch():
    with mock.patch("undeclared.sub.VALUE", 2):  # mock resolves the target with pkgutil.resolve_name
        pass
'''


@pytest.mark.parametrize("route", ["by_resolve_name", "by_pydoc_locate", "by_exec_in_fresh_globals",
                                   "by_mock_patch"])
@pytest.mark.parametrize("preloaded", [False, True], ids=["not-yet-imported", "already-imported"])
def test_the_standard_librarys_import_on_behalf_helpers_are_judged_as_their_caller(tmp_path, route, preloaded):
    """A real interpreter with the guard installed as an environment's .pth does (no mocks of the guard)."""
    import json
    import shutil
    import subprocess
    import sys

    from kiln.tasks.testing import importguard

    site = tmp_path / "site"
    (site / "probe_pkg").mkdir(parents=True)
    (site / "probe_pkg" / "__init__.py").write_text(HELPERS_BODY)
    (site / "undeclared").mkdir()
    (site / "undeclared" / "__init__.py").write_text("")
    (site / "undeclared" / "sub.py").write_text("VALUE = 1\n")
    (site / importguard.CONFIG).write_text(json.dumps({
        "packages": ["probe_pkg"], "wheel": "probe_pkg-1.0-py3-none-any.whl",
        "for_package": {"undeclared": ["undeclared-dist"]}, "for_tests": {}}))
    shutil.copyfile(importguard.__file__, site / f"{importguard.MODULE}.py")
    script = (f"import {importguard.MODULE}; {importguard.MODULE}.install()\n"
              + ("import undeclared.sub\n" if preloaded else "")  # the script may: it is neither role
              + f"import probe_pkg\nprobe_pkg.{route}()\n")

    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n{script}"],
                          capture_output=True, text=True, timeout=60)

    assert done.returncode != 0, done.stdout + done.stderr
    if route == "by_pydoc_locate" and not preloaded:
        assert "pydoc.locate found nothing" in done.stderr, done.stderr
        return
    assert "ModuleNotFoundError: No module named 'undeclared': probe_pkg imports it" in done.stderr, done.stderr
