"""Test selection through four real nightlies of the tiny CPU project, each test's outcome read from its report.

The fixture gains a module only one test imports (lazily, in its body), a test that always fails, and a test
whose outcome hangs on a flag file outside the project: an input the recording cannot see, planted here so a
full run can catch what selection would have missed.

1. The first nightly runs every test (no records).
2. A documentation-only commit: no test runs but the failing one; every passing test is carried, naming run 1.
3. A commit changing the lazily imported module and one test file: exactly the test that imported the module,
   that file's tests and the failing test run; the rest are carried (still naming run 1).
4. ``--full`` with the flag set: every test runs; the planted test fails where selection would have carried it,
   so the suite's recall unit fails, the summary says so, and selection is off for the suite.

Then two nightlies of a setuptools package with two C extension modules: a change to one extension's source
reruns exactly the tests that loaded it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.flows.report.summary import render_text
from kiln.tasks.project.config import load_config
from kiln.tasks.run.runs import artifact_store
from kiln.tasks.testing.selection_store import switched_off
from tests.helpers.gitrepo import commit_all, git_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LAZY = "tests/test_lazy.py::test_uses_extra"
BESIDE = "tests/test_lazy.py::test_needs_nothing_of_extra"
FAILS = "tests/test_bad.py::test_always_fails"
PLANTED = "tests/test_outside.py::test_reads_a_flag_outside_the_project"
TINY = ("tests/test_tiny.py::test_tiny_imports", "tests/test_tiny.py::test_every_module_imports")
ALL = {LAZY, BESIDE, FAILS, PLANTED, *TINY}


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, Path]:
    """The tiny CPU project with the tests above; (kiln.toml, the planted test's flag)."""
    flag = tmp_path / "outside-flag"

    def edit(repo: Path) -> None:
        text = (repo / "kiln.toml").read_text()
        head, _, rest = text.partition("[[variants]]")
        (repo / "kiln.toml").write_text(head + '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n\n'
                                        + rest[rest.index("[build]"):])
        (repo / "tinyk" / "extra.py").write_text("def value():\n    return 1\n")
        tests = repo / "tests"
        (tests / "test_lazy.py").write_text(
            "def test_uses_extra():\n    from tinyk import extra\n\n    assert extra.value() == 1\n\n\n"
            "def test_needs_nothing_of_extra():\n    assert True\n")
        (tests / "test_bad.py").write_text("def test_always_fails():\n    assert False, 'always'\n")
        (tests / "test_outside.py").write_text(
            "from pathlib import Path\n\n\n"
            f"def test_reads_a_flag_outside_the_project():\n    assert not Path({str(flag)!r}).exists()\n")
        (repo / "README.md").write_text("# tiny\n")

    return git_project("tiny", tmp_path, edit=edit), flag


def _nightly(config: Path, out: Path, **kwargs: object) -> RunManifest:
    from kiln.flows.nightly import nightly_flow

    state = nightly_flow(config_path=str(config), out=str(out), return_state=True, **kwargs)
    return RunManifest.load(out / str(state.state_details.flow_run_id))


def _tests(run: RunManifest, suite: str = "tiny") -> dict[str, dict]:
    report = json.loads((run.root / "tests" / f"{suite}.cpu.json").read_text())
    return {t["nodeid"]: t for t in report["tests"]}


def _ran(tests: dict[str, dict]) -> set[str]:
    return {n for n, t in tests.items() if not t["message"].startswith("carried from run ")}


def test_selection_carries_unchanged_tests_runs_changed_ones_and_a_full_run_catches_a_miss(prefect_server, project,
                                                                                             tmp_path):
    config, flag = project
    repo, out = config.parent, tmp_path / "out"

    first = _nightly(config, out)
    tests = _tests(first)
    assert set(tests) == ALL and _ran(tests) == ALL and tests[FAILS]["outcome"] == "failed"
    assert all(tests[n]["touched"] for n in ALL - {FAILS}), "the recording left a test without its inputs"

    (repo / "README.md").write_text("# tiny\n\nDocumentation only.\n")
    commit_all(repo, "docs only", when="2026-12-01T08:00:00+00:00")
    second = _nightly(config, out)
    tests = _tests(second)
    assert _ran(tests) == {FAILS}  # a failed test is never carried
    carried = f"carried from run {first.run_id}: its inputs are unchanged"
    assert {n: (tests[n]["outcome"], tests[n]["message"]) for n in ALL - {FAILS}} == {
        n: ("passed", carried) for n in ALL - {FAILS}}
    unit = {u.id: u for u in second.units}["test/tiny/cpu"]
    assert f"selection: 1 run, 5 carried from run {first.run_id[:8]}; CPU-seconds not spent:" in unit.message
    assert "test selection:" in render_text(second)

    (repo / "tinyk" / "extra.py").write_text("def value():\n    return 1  # changed bytes, same behaviour\n")
    (repo / "tests" / "test_tiny.py").write_text((repo / "tests" / "test_tiny.py").read_text() + "# changed\n")
    commit_all(repo, "one module and one test file", when="2026-12-02T08:00:00+00:00")
    third = _nightly(config, out)
    tests = _tests(third)
    assert _ran(tests) == {LAZY, FAILS, *TINY}
    assert {tests[n]["message"] for n in (BESIDE, PLANTED)} == {carried}  # still the run they ran in

    flag.write_text("")  # the planted input changes; selection cannot see it
    fourth = _nightly(config, out, full=True)
    tests = _tests(fourth)
    assert _ran(tests) == ALL and tests[PLANTED]["outcome"] == "failed"
    units = {u.id: u for u in fourth.units}
    recall = units["test/tiny/cpu/recall"]
    assert recall.state == "failed" and PLANTED in recall.message and "SELECTION RECALL MISS" in recall.message
    assert "SELECTION RECALL MISS in test/tiny/cpu" in render_text(fourth)
    loaded = load_config(config)
    assert PLANTED in switched_off(artifact_store(loaded), loaded.testing.quarantine, "tiny")

    # kiln test --explain runs nothing: it says why against the newest records (run 4's) and the wheels
    from kiln.flows.cli.selection import explain_selection, selection_on

    text = explain_selection(loaded, None, fourth.run_id, str(tmp_path / "explain"))
    assert f"run    {BESIDE}  — SELECTION RECALL MISS in test/tiny/cpu" in text  # off until a person says
    assert selection_on(loaded, "tiny").startswith("selection is on again for suite tiny (it was off: SELECTION")
    text = explain_selection(loaded, None, fourth.run_id, str(tmp_path / "explain"))
    assert f"carry  {BESIDE}  — carried from run {fourth.run_id}: its inputs are unchanged" in text
    assert f"run    {PLANTED}  — its last outcome was failed (only a pass is carried)" in text


# A package that builds itself (setuptools, pep517) with two extension modules, each a translation unit of its
# own: a test's record holds the shared library it loaded, so a change to one extension's C source reruns only
# the tests that loaded it. The tests import lazily (in their bodies): what collection imports counts for every
# test of the worker.
_EXT = '''#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *value(PyObject *self, PyObject *unused) { return PyLong_FromLong(%(value)d); }

static PyMethodDef methods[] = {{"value", value, METH_NOARGS, "%(doc)s"}, {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, methods};

PyMODINIT_FUNC PyInit_%(name)s(void) { return PyModule_Create(&module); }
'''
EXT_A, EXT_B = "tests/test_a.py::test_calls_a", "tests/test_b.py::test_calls_b"
NEITHER = "tests/test_neither.py::test_uses_no_extension"


def _two_extensions(repo: Path) -> None:
    text = (repo / "kiln.toml").read_text()
    cells = text[text.index("python = ["):]
    (repo / "kiln.toml").write_text(text.replace(cells[:cells.index("\n") + 1], ""))  # this Python only
    (repo / "cmx" / "_speedup.c").unlink()
    (repo / "tests" / "test_cmx.py").unlink()
    for name, value in (("_a", 1), ("_b", 2)):
        (repo / "cmx" / f"{name}.c").write_text(_EXT % {"name": name, "value": value, "doc": "a value"})
        (repo / "tests" / f"test{name}.py").write_text(
            f"def test_calls{name}():\n    from cmx import {name}\n\n    assert {name}.value() == {value}\n")
    (repo / "tests" / "test_neither.py").write_text("def test_uses_no_extension():\n    import cmx\n\n"
                                                    "    assert cmx.__doc__\n")
    (repo / "cmx" / "__init__.py").write_text('"""Two extension modules, neither imported here."""\n')
    (repo / "setup.py").write_text(
        "from setuptools import Extension, setup\n\n"
        "setup(packages=['cmx'], ext_modules=[Extension('cmx._a', ['cmx/_a.c']), Extension('cmx._b', ['cmx/_b.c'])])\n")


def test_a_change_to_one_extension_modules_c_source_reruns_only_the_tests_that_loaded_it(prefect_server, tmp_path):
    config = git_project("cmatrix", tmp_path, edit=_two_extensions)
    repo, out = config.parent, tmp_path / "out"

    first = _nightly(config, out)
    tests = _tests(first, "unit")
    assert _ran(tests) == {EXT_A, EXT_B, NEITHER} and {t["outcome"] for t in tests.values()} == {"passed"}
    for test, mine in ((EXT_A, "_a"), (EXT_B, "_b")):  # its own extension's library, not the other's
        libraries = {k for k in tests[test]["touched"] if k.endswith(".so")}
        assert [k.startswith(f"wheel:cmx/{mine}.") for k in libraries] == [True], (test, libraries)
    assert not any(k.endswith(".so") for k in tests[NEITHER]["touched"]), tests[NEITHER]["touched"]

    (repo / "cmx" / "_a.c").write_text(_EXT % {"name": "_a", "value": 1, "doc": "a value, new bytes"})
    commit_all(repo, "one extension's source", when="2026-12-01T08:00:00+00:00")
    second = _nightly(config, out)
    tests = _tests(second, "unit")
    assert _ran(tests) == {EXT_A} and tests[EXT_A]["outcome"] == "passed"
    carried = f"carried from run {first.run_id}: its inputs are unchanged"
    assert {n: (tests[n]["outcome"], tests[n]["message"]) for n in (EXT_B, NEITHER)} == {
        n: ("passed", carried) for n in (EXT_B, NEITHER)}
