"""What a test touched: recorded by the real worker per test, mapped to stable keys, fingerprinted by content."""

from __future__ import annotations

import _bisect
import _csv
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.core.venvs import uv_command
from kiln.tasks.testing import envs, touch
from kiln.tasks.testing.classify import TestResult, classify_phases
from kiln.tasks.testing.reports import summary, touched_of
from kiln.tasks.testing.runner import RunOptions, run_tests
from kiln.tasks.testing.touch import (
    ABSENT,
    TESTED_ENV,
    environment_lock,
    fingerprint,
    mapped_files,
    unstamped_metadata,
    wheel_key,
)
from tests.helpers.wheelkit import make_wheel

LAZY = "VALUE = 1\n"
TEST_FILE = """\
import json
import pathlib

import pytest
import touchpkg

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_lazy_and_data(marker, monkeypatch):
    from touchpkg import lazy

    assert lazy.VALUE == 1
    monkeypatch.chdir(ROOT / "data")  # a relative open counts from where it was made, not where the test ends
    assert pathlib.Path("table.txt").read_text() == "x\\n"
    assert json.loads((pathlib.Path(touchpkg.__file__).parent / "table.json").read_text()) == {"a": 1}


def test_plain(marker):
    assert touchpkg.PAYLOAD == ""


def test_tries_a_missing_module():
    with pytest.raises(ImportError):
        import touchpkg.missing  # noqa: F401
    (ROOT / "tests_t" / "written.txt").write_text("an output, not an input")


def test_native():
    import ctypes

    from touchpkg import _bisect

    assert _bisect.bisect_right([1, 2, 3], 2) == 2
    ctypes.CDLL(str(pathlib.Path(touchpkg.__file__).parent / "libnative.so"))
"""
# Real shared objects for the wheel: a stdlib extension module (imported as the package's own) and a library
# loaded with ctypes; copies of the interpreter's, so the test needs no compiler.
EXTENSION = f"touchpkg/_bisect{sysconfig.get_config_var('EXT_SUFFIX')}"
NATIVE = {EXTENSION: Path(_bisect.__file__).read_bytes(), "touchpkg/libnative.so": Path(_csv.__file__).read_bytes()}
OWN = {"test:conftest.py", "test:pytest.ini", "test:tests_t/conftest.py", "test:tests_t/test_fixture.py"}


def _wheel(directory: Path, version: str = "1.0", lazy: str = LAZY) -> Path:
    return make_wheel(directory, "touchpkg", version,
                      files={"touchpkg/lazy.py": lazy.encode(), "touchpkg/table.json": b'{"a": 1}', **NATIVE})


def _project(tmp: Path) -> tuple[Path, Path]:
    """(project root, the folder the fixture wheel is installed into, as ``pip install --target`` does)."""
    root = tmp / "project"
    (root / "tests_t").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text("# the root conftest: every test's input\n")
    (root / "tests_t" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef marker():\n    return 1\n")
    (root / "tests_t" / "test_fixture.py").write_text(TEST_FILE)
    (root / "data" / "table.txt").write_text("x\n")
    site = tmp / "work" / "site"
    subprocess.run([*uv_command(), "pip", "install", "--quiet", "--no-deps", "--offline", "--python", sys.executable,
                    "--target", str(site), str(_wheel(tmp / "dist"))], check=True, timeout=120, capture_output=True)
    return root, site


def _run(tmp: Path, **options) -> dict[str, TestResult]:
    root, site = _project(tmp)
    env = {"PYTHONPATH": str(site), TESTED_ENV: "touchpkg"}
    results = run_tests(["tests_t"], root, tmp / "work", RunOptions(preload=(), env=env, **options))
    return {r.nodeid.rsplit("::", 1)[-1]: r for r in results}


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> dict[str, TestResult]:
    return _run(tmp_path_factory.mktemp("touch"))


def test_every_fixture_test_passes_with_recording_on(forked):
    assert {name: r.outcome for name, r in forked.items()} == {
        "test_lazy_and_data": "passed", "test_plain": "passed", "test_tries_a_missing_module": "passed",
        "test_native": "passed"}


def test_a_lazily_imported_module_and_opened_files_are_the_importing_tests_only(forked):
    lazy, plain = set(forked["test_lazy_and_data"].touched), set(forked["test_plain"].touched)
    mine = {"wheel:touchpkg/lazy.py", "wheel:touchpkg/table.json", "test:data/table.txt"}
    assert mine <= lazy
    assert not mine & plain


def test_an_extension_module_and_a_dlopened_library_are_the_loading_tests_only(forked):
    native = {f"wheel:{EXTENSION}", "wheel:touchpkg/libnative.so"}
    assert native <= set(forked["test_native"].touched)
    assert not native & set(forked["test_lazy_and_data"].touched)
    assert not native & set(forked["test_plain"].touched)


def test_modules_imported_at_collection_count_for_every_test(forked):
    for result in forked.values():
        assert "wheel:touchpkg/__init__.py" in result.touched, result.nodeid


def test_test_file_conftests_and_pytest_config_are_always_inputs(forked):
    for result in forked.values():
        assert OWN <= set(result.touched), result.nodeid
    assert {k for k in forked["test_plain"].touched if k.startswith("test:")} == OWN


def test_keys_are_sorted_and_only_wheel_or_project_files(forked):
    for result in forked.values():
        assert list(result.touched) == sorted(result.touched)
        assert all(k.startswith(("wheel:", "test:")) for k in result.touched), result.touched
        assert not [k for k in result.touched if "site" in k or "work" in k or "dist-info" in k]


def test_a_file_the_test_only_wrote_is_no_input(forked):
    assert "test:tests_t/written.txt" not in forked["test_tries_a_missing_module"].touched


def test_a_missing_module_of_the_wheel_the_test_tried_is_an_input(forked):
    assert "wheel:touchpkg/missing.py" in forked["test_tries_a_missing_module"].touched
    assert "wheel:touchpkg/missing.py" not in forked["test_plain"].touched


def test_the_suite_json_carries_each_tests_keys(forked):
    tests = {t["nodeid"].rsplit("::", 1)[-1]: t for t in summary("s", list(forked.values()))["tests"]}
    assert tuple(tests["test_lazy_and_data"]["touched"]) == forked["test_lazy_and_data"].touched
    assert touched_of(tests["test_plain"]) == forked["test_plain"].touched


def test_tests_sharing_a_process_count_what_earlier_ones_loaded(tmp_path):
    # isolate="file": one process runs the file's tests in order; a module stays loaded, so the later tests'
    # records include it (conservative: a record may hold too much, never too little).
    results = _run(tmp_path, isolate="file")
    assert "wheel:touchpkg/lazy.py" in results["test_plain"].touched  # test_lazy_and_data ran first
    assert "test:data/table.txt" not in results["test_plain"].touched  # an open is the opening test's alone


@pytest.mark.slow
def test_spawned_jobs_record_like_forked_ones(tmp_path):
    results = _run(tmp_path, start="spawn")
    assert {"wheel:touchpkg/lazy.py", "test:data/table.txt"} <= set(results["test_lazy_and_data"].touched)
    assert "wheel:touchpkg/lazy.py" not in results["test_plain"].touched


@pytest.mark.slow
def test_a_suite_environment_names_its_tested_distribution_through_the_import_guard(tmp_path):
    # The path a suite takes: make_env installs the wheel and its import guard; the worker is told nothing.
    root, _ = _project(tmp_path)
    env = envs.make_env(tmp_path / "env", [_wheel(tmp_path / "dist")], tests_root=root, test_paths=["tests_t"])
    results = run_tests(["tests_t"], root, tmp_path / "work", RunOptions(python=str(env.python), preload=(), gpus=0))
    by_name = {r.nodeid.rsplit("::", 1)[-1]: r for r in results}
    assert by_name["test_lazy_and_data"].outcome == "passed"
    assert {"wheel:touchpkg/lazy.py", "test:data/table.txt"} <= set(by_name["test_lazy_and_data"].touched)
    assert "wheel:touchpkg/lazy.py" not in by_name["test_plain"].touched


def test_without_a_tested_distribution_nothing_is_recorded(tmp_path):
    root, site = _project(tmp_path)
    results = run_tests(["tests_t"], root, tmp_path / "work", RunOptions(preload=(), env={"PYTHONPATH": str(site)}))
    assert [r.outcome for r in results] == ["passed"] * 4
    assert all(r.touched == () for r in results)


def test_a_summary_written_before_touched_keys_reads_as_no_record():
    assert touched_of({"nodeid": "t.py::t", "outcome": "passed"}) == ()
    assert classify_phases("t.py::t", [{"when": "call", "outcome": "passed"}]).touched == ()


# --- fingerprints ---------------------------------------------------------------------------------------------

KEYS = ["wheel:touchpkg/__init__.py", "wheel:touchpkg/lazy.py", "wheel:{dist-info}/METADATA"]


def test_fingerprint_changes_with_a_changed_member_only(tmp_path):
    before = fingerprint(KEYS, _wheel(tmp_path / "a"), tmp_path)
    after = fingerprint(KEYS, _wheel(tmp_path / "b", lazy="VALUE = 2\n"), tmp_path)
    assert before["wheel:touchpkg/lazy.py"] != after["wheel:touchpkg/lazy.py"]
    assert {k: v for k, v in before.items() if "lazy" not in k} == {k: v for k, v in after.items() if "lazy" not in k}


def test_fingerprint_ignores_the_version_stamp_in_metadata(tmp_path):
    keys = KEYS[1:]  # the fixture wheel's __init__.py states its version: a member that does change
    nightly = fingerprint(keys, _wheel(tmp_path / "a", "1.0.dev20261206"), tmp_path)
    assert fingerprint(keys, _wheel(tmp_path / "b", "1.0.dev20261207"), tmp_path) == nightly
    assert all(len(v) == 64 for v in nightly.values())


def test_fingerprint_of_a_missing_member_or_file_is_absent(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    keys = ["wheel:touchpkg/missing.py", "wheel:{dist-info}/RECORD", "test:gone.txt", "test:data.txt"]
    prints = fingerprint(keys, _wheel(tmp_path / "a"), tmp_path)
    assert prints["wheel:touchpkg/missing.py"] == prints["wheel:{dist-info}/RECORD"] == ABSENT
    assert prints["test:gone.txt"] == ABSENT and prints["test:data.txt"] != ABSENT
    (tmp_path / "data.txt").write_text("y")
    assert fingerprint(["test:data.txt"], tmp_path / "a" / "missing.whl", tmp_path) != {"test:data.txt": prints[
        "test:data.txt"]}


@pytest.mark.parametrize("key", ["other:x", "test:../outside.txt", "test:/etc/passwd"])
def test_fingerprint_refuses_a_bad_key_naming_it(tmp_path, key):
    with pytest.raises(InvalidInputError, match="touched key"):
        fingerprint([key], _wheel(tmp_path / "a"), tmp_path)


def test_environment_lock_is_stable_and_leaves_out_the_tested_distribution():
    lock = environment_lock(sys.executable, "pytest")
    assert lock == environment_lock(sys.executable, "PyTest")
    assert lock != environment_lock(sys.executable, "no-such-distribution")


def test_environment_lock_names_a_missing_interpreter(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        environment_lock(tmp_path / "python", "x")


# --- the pure parts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("record", "key"), [
    ("pkg/mod.py", "wheel:pkg/mod.py"),
    ("pkg/_aot/k.cubin", "wheel:pkg/_aot/k.cubin"),
    ("pkg-1.0.dist-info/METADATA", "wheel:{dist-info}/METADATA"),
    ("pkg-1.0.dist-info/RECORD", None),
    ("pkg-1.0.dist-info/INSTALLER", None),
    ("pkg/__pycache__/mod.cpython-311.pyc", None),
    ("../../bin/tool", None),
])
def test_wheel_key_of_a_record_path(record, key):
    assert wheel_key(record) == key


def test_mapped_files_reads_paths_from_proc_maps():
    maps = ("7f00-7f01 r-xp 00000000 08:01 12 /site/pkg/_ext.so\n"
            "7f01-7f02 rw-p 00000000 00:00 0 \n"
            "7f02-7f03 r--p 00000000 00:00 0 [heap]\n"
            "7f03-7f04 r--p 00000000 08:01 13 /tmp/x.so (deleted)\n")
    assert mapped_files(maps) == {"/site/pkg/_ext.so", "/tmp/x.so"}


def test_unstamped_metadata_drops_only_the_version_header():
    text = b"Metadata-Version: 2.1\nName: p\nVersion: 1.0\n\nVersion: 1.0 in the description stays\n"
    assert unstamped_metadata(text) == b"Metadata-Version: 2.1\nName: p\n\nVersion: 1.0 in the description stays\n"


def test_tested_distribution_comes_from_the_environment_first():
    assert touch.tested_distribution({TESTED_ENV: "kiln-kernels"}) == "kiln-kernels"


def test_recorded_keys_travel_through_the_json_results():
    phases = [{"when": "setup", "outcome": "passed"}, {"when": "call", "outcome": "passed"},
              {"when": "teardown", "outcome": "passed", "touched": ["test:b", "test:a"]}]
    assert classify_phases("t.py::t", json.loads(json.dumps(phases))).touched == ("test:a", "test:b")
