"""Build run directories (run.json + wheels) for publish tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.release.manifest import RunManifest, Unit
from kiln.release.record import Checkout, RunHeader, RunRecord, create_record
from kiln.release.store import open_store

from .wheelkit import make_wheel


def make_run(root: Path, wheels: dict[str, list[tuple[str, str]]], units: list[Unit] = (), payload: str = "") -> RunManifest:
    """A saved run with ``{variant: [(name, version), ...]}`` wheels recorded as artifacts."""
    run = RunManifest(root=root, run_id=uuid.uuid4().hex, flow="test")
    for variant, entries in wheels.items():
        for name, version in entries:
            path = make_wheel(root / "wheels" / variant, name, version, payload=payload)
            run.add_artifact(path, step="build", kind="wheel", variant=variant)
    for unit in units:
        run.add_unit(unit)
    run.save()
    return run


CLEAN = Checkout(commit="0" * 40, commit_time=1764536823, in_git=True)


def make_record(config_path: str | Path, out: Path, wheels: dict[str, list[tuple[str, str]]],
                units: Sequence[Unit] = (), payload: str = "", source: Checkout = CLEAN) -> RunRecord:
    """A run record in the config's artifact store, as a build would leave it (a clean commit by default)."""
    from kiln.tasks.project.config import load_config

    config = load_config(config_path)
    store = open_store(config.artifacts.url, root=config.root)
    header = RunHeader(run_id=uuid.uuid4().hex, flow="test", version="1.0", source=source)
    record = create_record(store, header, out)
    for variant, entries in wheels.items():
        for name, version in entries:
            path = make_wheel(record.view / "wheels" / variant, name, version, payload=payload)
            record.add_artifact(path, step="build", kind="wheel", variant=variant)
    for unit in units:
        record.record(unit)
    return record


def run_at_once(publish_one: Callable[[Any], None], items: Sequence[Any], timeout_s: float = 120) -> list[BaseException]:
    """Call ``publish_one(item)`` for every item on its own thread, all released together.

    Returns what the threads raised, so the caller asserts on it in the test thread.
    """
    barrier, errors = threading.Barrier(len(items)), []

    def one(item: Any) -> None:
        try:
            barrier.wait(timeout=30)
            publish_one(item)
        except BaseException as exc:  # collected and asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return errors
