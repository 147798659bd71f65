"""The run record on its own: header round trip, per-unit objects, concurrent writers, fetch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.manifest import Unit
from kiln.core.record import Checkout, RunHeader, create_record, open_record
from kiln.core.store import LocalStore


def _record(tmp_path: Path, run_id: str = "run-1"):
    store = LocalStore(tmp_path / "artifacts")
    header = RunHeader(run_id=run_id, flow="nightly", version="1.0.dev1",
                       source=Checkout("a" * 40, 1764536823, ("src/x.py",), True), created=1.0)
    return store, create_record(store, header, tmp_path / "out")


def test_the_header_round_trips_with_the_tree_state(tmp_path):
    store, record = _record(tmp_path)
    again = open_record(store, "run-1", tmp_path / "elsewhere")
    assert again.header == record.header
    assert again.header.source.modified == ("src/x.py",)
    assert "differ from commit aaaaaaaaaaaa" in again.header.source.unpublishable()


def test_concurrent_unit_writers_lose_nothing(tmp_path):
    _, record = _record(tmp_path)
    units = [Unit(f"build/cpu/k{n}", "build", "completed", variant="cpu") for n in range(64)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(record.record, units))
    assert [u.id for u in record.units()] == sorted(u.id for u in units)


def test_a_unit_rewritten_keeps_only_its_last_state(tmp_path):
    _, record = _record(tmp_path)
    record.record(Unit("publish/cpu/x.whl", "publish", "failed", message="throttled"))
    record.record(Unit("publish/cpu/x.whl", "publish", "completed", message="added"))
    assert [(u.state, u.message) for u in record.units()] == [("completed", "added")]


def test_an_artifact_fetched_on_another_machine_is_verified(tmp_path):
    store, record = _record(tmp_path)
    wheel = record.view / "wheels" / "x-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"wheel bytes")
    (artifact,) = [record.add_artifact(wheel, step="build", kind="wheel", variant="cpu")]
    other = open_record(store, "run-1", tmp_path / "worker2")  # an empty local view
    assert other.fetch(artifact).read_bytes() == b"wheel bytes"
    (store.root / "runs" / "run-1" / "files" / artifact.path).write_bytes(b"tampered")
    (other.view / artifact.path).unlink()
    with pytest.raises(IntegrityError, match="changed after it was built"):
        other.fetch(artifact)


def test_each_run_has_its_own_record_and_latest_names_the_newest_build(tmp_path):
    store, first = _record(tmp_path, "run-1")
    _, second = _record(tmp_path, "run-2")
    first.record(Unit("build/cpu/wheel", "build", "completed"))
    assert second.units() == []
    first.mark_latest()
    assert open_record(store, "latest", tmp_path / "out").run_id == "run-1"
    second.mark_latest()
    assert open_record(store, "latest", tmp_path / "out").run_id == "run-2"


@pytest.mark.parametrize("run_id", ["../etc", "a/b", "", "x y"])
def test_bad_run_ids_are_refused(tmp_path, run_id):
    store = LocalStore(tmp_path / "artifacts")
    with pytest.raises(InvalidInputError, match="run id"):
        open_record(store, run_id, tmp_path / "out")


def test_a_batch_of_units_and_artifacts_is_written_whole_and_in_order(tmp_path):
    _, record = _record(tmp_path)
    units = [Unit(f"build/cpu/k{n:03d}", "build", "completed", variant="cpu") for n in range(40)]
    assert record.record_all(units) == units
    paths = []
    for n in range(12):
        path = record.view / "build" / "cpu" / f"k{n}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * n)
        paths.append(path)
    added = record.add_artifacts((p, "build", "cubin", "cpu") for p in paths)
    assert [a.path for a in added] == [p.relative_to(record.view).as_posix() for p in paths]
    assert [u.id for u in record.units()] == [u.id for u in units]
    assert sorted(a.path for a in record.artifacts()) == sorted(a.path for a in added)


def test_a_failed_write_in_a_batch_is_raised_after_the_others_are_written(tmp_path):
    _, record = _record(tmp_path)
    good = record.view / "good.bin"
    good.parent.mkdir(parents=True, exist_ok=True)
    good.write_bytes(b"ok")
    with pytest.raises(FileNotFoundError):
        record.add_artifacts([(record.view / "missing.bin", "build", "cubin", None), (good, "build", "cubin", None)])
    assert [a.path for a in record.artifacts()] == ["good.bin"]
