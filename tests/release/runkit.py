"""Build run directories (run.json + wheels) for publish tests."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from release.manifest import RunManifest, Unit

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
