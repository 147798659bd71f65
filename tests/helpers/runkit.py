"""Build run directories (run.json + wheels) for publish tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.core.manifest import RunManifest, Unit
from kiln.core.record import Checkout, RunHeader, RunRecord, create_record
from kiln.core.store import open_store
from kiln.release.index.variants import VARIANT_SCHEMA, dumps
from tests.helpers.wheelkit import make_wheel

NVIDIA = {"plugin-api": "nvidia_variant_provider.plugin:NvidiaVariantPlugin",
          "requires": ["nvidia-variant-provider>=0.0.1,<1.0.0"]}
CU130 = {"nvidia": {"cuda_version_lower_bound": ["13.0"], "sm_arch": ["80_real", "90_real"]}}


def variant_document(label: str, properties: dict[str, Any]) -> bytes:
    """A ``variant.json`` as Kiln's build writes it (PEP 850 schema, the NVIDIA provider)."""
    return dumps({"$schema": VARIANT_SCHEMA, "default-priorities": {"namespace": ["nvidia"]},
                  "providers": {"nvidia": NVIDIA}, "variants": {label: properties}})


def make_variant_run(root: Path, name: str, version: str, labels: dict[str, dict[str, Any]],
                     payload: str = "") -> RunManifest:
    """A saved run as a build of ``{variant: properties}`` leaves it: each variant's ``+variant`` wheel, its
    variant wheel (label: the variant's name; ``cpu`` is the ``null`` variant) and, for cpu, the plain default."""
    run = RunManifest(root=root, run_id=uuid.uuid4().hex, flow="test")
    for variant, properties in labels.items():
        local = make_wheel(root / "wheels" / variant, name, f"{version}+{variant}", payload=payload)
        run.add_artifact(local, step="build", kind="wheel", variant=variant)
        label = "null" if variant == "cpu" else variant
        tag = "py3-none-any" if variant == "cpu" else "py3-none-linux_x86_64"
        wheels = [make_wheel(root / "variant-wheels", name, version, tag=tag, payload=payload, label=label,
                             variant_json=variant_document(label, properties))]
        if variant == "cpu":
            wheels.append(make_wheel(root / "variant-wheels", name, version, payload=payload))
        for path in wheels:
            run.add_artifact(path, step="build", kind="variant-wheel", variant=variant)
    run.save()
    return run


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
                units: Sequence[Unit] = (), payload: str = "", source: Checkout = CLEAN,
                requires: Sequence[str] = ()) -> RunRecord:
    """A run record in the config's artifact store, as a build would leave it (a clean commit by default)."""
    from kiln.tasks.project.config import load_config

    config = load_config(config_path)
    store = open_store(config.artifacts.url, root=config.root)
    header = RunHeader(run_id=uuid.uuid4().hex, flow="test", version="1.0", source=source)
    record = create_record(store, header, out)
    for variant, entries in wheels.items():
        for name, version in entries:
            path = make_wheel(record.view / "wheels" / variant, name, version, payload=payload, requires=requires)
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
