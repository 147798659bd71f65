"""Build run directories (run.json + wheels) for publish tests."""

from __future__ import annotations

import uuid
from pathlib import Path

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
