"""The compile pool: a worker's exception crosses back with its type and traceback; a hung
call goes down the shared termination ladder of kiln.tasks.process with its stacks dumped."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import BuildWorkerError, CompileError, KilnError, is_retryable
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.pool import RemoteTraceback, UnpicklableRemoteError, WorkerPool, WorkerTimeout
from kiln.tasks.build.stage import prepare_build, worker_config
from kiln.tasks.build.units import CompileContext, build_unit, unit_record
from tests.helpers import pool_targets
from tests.helpers.procs_tree import running
from tests.helpers.projects import copy_project

TARGETS = "tests.helpers.pool_targets"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    triton_cache = tmp_path_factory.mktemp("triton-cache")
    # sandboxed workers: the tests' own directories are the project they read and the outputs they write
    base = str(tmp_path_factory.getbasetemp())
    with WorkerPool(1, {"TRITON_INTERPRET": None, "TRITON_CACHE_DIR": str(triton_cache)}, read=(base,),
                    write=(base,)) as pool:
        yield pool


def _warm(pool: WorkerPool) -> None:
    """Import the targets module in the (single) worker, so a deadline below only times the target."""
    assert pool.call(f"{TARGETS}:noop", 7, timeout=120) == 7


class _Redirect:
    """Fault injection: the real pool, with the compile target swapped for one that fails in the worker."""

    def __init__(self, pool: WorkerPool, target: str) -> None:
        self.pool, self.target = pool, target

    def call(self, target: str, request: Any, timeout: float) -> Any:
        return self.pool.call(self.target, request, timeout)


def test_import_error_in_a_compile_worker_is_an_error_of_the_worker_with_its_traceback(pool, tmp_path):
    setup = prepare_build(str(copy_project("tiny", tmp_path)), "0.1.0", ["cu130"])
    unit = next(u for u in setup.plan.units if u.id == "build/cu130/9.0/add/fp32_b64")
    env = CompileContext(worker_config(setup), tmp_path / "out" / "build", BuildCache(tmp_path / "cache"),
                   _Redirect(pool, f"{TARGETS}:compile_with_triton_missing"), 120, setup.plan.toolchain)  # type: ignore[arg-type]
    with pytest.raises(BuildWorkerError) as info:
        build_unit(unit, env)
    error = info.value
    assert not isinstance(error, CompileError) and not is_retryable(error)
    assert error.error_type == "ModuleNotFoundError" and error.target == f"{TARGETS}:compile_with_triton_missing"
    assert "pid " in error.worker and "not a compile failure" in str(error)
    original = error.__cause__
    assert isinstance(original, ImportError)  # the worker's exception itself, as its own type
    remote = original.__cause__
    assert isinstance(remote, RemoteTraceback)
    assert "in compile_in_worker" in remote.tb and "import triton" in remote.tb and "aot.py" in remote.tb
    assert unit_record(unit, error).message.startswith("BuildWorkerError: build worker pid ")
    assert pool.call(f"{TARGETS}:noop", "still serving", timeout=120) == "still serving"


def test_a_kiln_error_subclass_raised_in_a_worker_arrives_as_that_subclass(pool):
    with pytest.raises(pool_targets.FixtureCompileError, match="fixture compile failure for 3") as info:
        pool.call(f"{TARGETS}:raise_fixture_error", 3, timeout=120)
    assert type(info.value) is pool_targets.FixtureCompileError and isinstance(info.value, KilnError)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "in raise_fixture_error" in str(info.value.__cause__)


def test_an_exception_that_cannot_be_unpickled_keeps_its_type_name_and_traceback(pool):
    with pytest.raises(BuildWorkerError) as info:
        pool.call(f"{TARGETS}:raise_unpicklable", "x", timeout=120)
    assert info.value.error_type == f"{TARGETS}.TwoArgError"
    stand_in = info.value.__cause__
    assert isinstance(stand_in, UnpicklableRemoteError) and stand_in.qualname == f"{TARGETS}.TwoArgError"
    assert "the fixture failed: x" in str(info.value)
    assert "in raise_unpicklable" in stand_in.__cause__.tb and "TwoArgError" in stand_in.__cause__.tb


def test_a_hung_call_is_killed_through_the_shared_ladder_with_its_stacks_dumped(pool):
    _warm(pool)
    with pytest.raises(WorkerTimeout, match="ran past its 3 s deadline") as info:
        pool.call(f"{TARGETS}:hang_in_named_frame", None, timeout=3)
    error = info.value
    assert error.escalation == "sigterm"
    assert "in hang_in_named_frame" in error.stacks and "pool_targets.py" in error.stacks
    assert error.ladder == "stacks dumped, process group ended by SIGTERM" and error.ladder in str(error)
    assert pool.call(f"{TARGETS}:noop", "replaced", timeout=120) == "replaced"


def test_a_worker_that_ignores_sigterm_is_sigkilled_after_the_grace(pool):
    _warm(pool)
    with pytest.raises(WorkerTimeout) as info:
        pool.call(f"{TARGETS}:hang_ignoring_sigterm", None, timeout=3)
    assert info.value.escalation == "sigkill" and "in hang_in_named_frame" in info.value.stacks
    assert "SIGKILL" in info.value.ladder


def _wait_until_gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while running(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not running(pid)


def test_the_ladder_reaches_the_workers_compiler_subprocesses(pool, tmp_path):
    _warm(pool)
    pid_file = tmp_path / "child.pid"
    with pytest.raises(WorkerTimeout):
        pool.call(f"{TARGETS}:hang_with_a_compiler_child", str(pid_file), timeout=3)
    child = int(Path(pid_file).read_text())
    assert _wait_until_gone(child, within_s=10), f"the worker's subprocess {child} outlived it"


def test_modules_planted_in_the_working_directory_are_never_imported_by_a_compile_worker(tmp_path, monkeypatch):
    """A user who can write the directory a kiln build runs in plants ``socket.py`` and ``pickle.py`` (a worker's
    connection imports both) and ``json.py``; each writes a marker when imported. The worker starts with ``-P``
    (``multiprocessing``'s spawn ran ``python -c`` there, which imported the planted ``socket.py``)."""
    shared, markers = tmp_path / "shared", tmp_path / "markers"
    shared.mkdir()
    markers.mkdir()
    for name in ("socket", "pickle", "json"):
        (shared / f"{name}.py").write_text(f"open({str(markers / name)!r}, 'w').close()\n")
    monkeypatch.chdir(shared)
    with WorkerPool(1, {"KILN_POOL_PROBE": "set"}) as pool:
        assert pool.call(f"{TARGETS}:imported_from", "json", timeout=120) != str(shared / "json.py")
        assert pool.call(f"{TARGETS}:environ", "KILN_POOL_PROBE", timeout=120) == "set"
    assert sorted(p.name for p in markers.iterdir()) == []
