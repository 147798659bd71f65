"""The publish stage as a flow: one task run per wheel upload, then the pages.

The protocol itself (order, verification, merging, CAS) is
:mod:`release.publish`; this module only orders it into Prefect tasks so the
UI shows which upload failed, retries what is retryable, and leaves the plan
and the index link as an artifact.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import allow_failure

from flows.common import finish_stage, markdown_report, open_run, record, retry_on_retryable
from release.errors import ConfigError, KilnError
from release.manifest import RunManifest, Unit
from release.pins import fetch_pins, load_pins
from release.publish import Plan, Upload, UploadResult, collect, index_prefix, publish_pages, raise_for_conflict, upload_file
from release.staging import StagingStore
from release.store import Store
from tasks import releasing
from tasks.config import load_config

UPLOAD_RETRIES = 3
STAGING_DIR = "publish-staging"
PINS_DIR = "pins"


def _session(config: Any, channel: str, target: str) -> Any:
    """Credentials of the publish step for this channel (one line to swap per credential source)."""
    if config.publish.targets[target].kind != "s3":
        return None
    from flows.credentials import session_for

    return session_for(config, f"publish-{channel}")


@task(name="prepare-publish", cache_policy=NO_CACHE)
def prepare_publish(run: RunManifest, config_path: str, out: str, target: str | None, channel: str,
                    dry_run: bool) -> tuple[Store, Plan]:
    """Open the target (or its staging copy), verify every file against the manifest, gate variants."""
    config = load_config(config_path)
    name = target or config.publish.default_target
    if name not in config.publish.targets:
        raise ConfigError(f"unknown publish target {name!r}; kiln.toml defines {sorted(config.publish.targets)}")
    prefix = releasing.channel_prefix(config, channel)
    store = releasing.open_target(config, out, _session(config, channel, name), name)
    if dry_run:
        staging = Path(out) / STAGING_DIR
        staging.mkdir(parents=True, exist_ok=True)
        store = StagingStore(store, Path(tempfile.mkdtemp(dir=staging)))
    extra = fetch_pins(load_pins(), Path(out) / PINS_DIR)
    uploads, skipped = collect(run, prefix, [v.name for v in config.variants], time.time, extra)
    for variant, why in skipped.items():
        record(run, Unit(f"publish/{variant}", "publish", "skipped", variant=variant, message=why))
    return store, Plan(store.url, channel, uploads, skipped, dry_run=dry_run)


@task(name="upload-wheel", retries=UPLOAD_RETRIES, retry_delay_seconds=[1, 5, 15],
      retry_condition_fn=retry_on_retryable, cache_policy=NO_CACHE,
      task_run_name="upload {upload.variant}/{upload.dist.filename}")
def upload_wheel(run: RunManifest, store: Store, upload: Upload) -> UploadResult:
    """Wheel, then sidecar, both verified; a conflict fails this unit only."""
    start = time.monotonic()
    try:
        result = raise_for_conflict(upload_file(store, upload))
    except KilnError as exc:
        record(run, Unit(upload.unit_id, "publish", "failed", variant=upload.variant, message=str(exc),
                         duration_s=time.monotonic() - start))
        raise
    record(run, Unit(upload.unit_id, "publish", "completed", variant=upload.variant, message=result.outcome,
                     duration_s=time.monotonic() - start))
    return result


@task(name="publish-pages", retries=UPLOAD_RETRIES, retry_delay_seconds=[1, 5, 15],
      retry_condition_fn=retry_on_retryable, cache_policy=NO_CACHE)
def publish_index_pages(run: RunManifest, store: Store, plan: Plan, results: list[Any]) -> Plan:
    """Project pages then root, for the files whose upload verified; the plan as an artifact."""
    plan.results = [r for r in results if isinstance(r, UploadResult)]
    try:
        plan.pages = publish_pages(store, plan.results)
    except KilnError as exc:
        record(run, Unit("publish/pages", "publish", "failed", message=str(exc)))
        raise
    record(run, Unit("publish/pages", "publish", "completed", message=f"{len(plan.pages)} pages changed"))
    indexes = sorted({f"{store.url}/{u.index}/" for u in plan.uploads})
    run.info["index_url" if not plan.dry_run else "dry_run_index_url"] = indexes
    run.info["publish_plan"] = plan.to_markdown()
    run.save()
    links = "\n".join(f"- index: <{url}>" for url in indexes) or "- no index changed"
    markdown_report("kiln-publish-plan", plan.to_markdown() + "\n" + links + "\n", f"Publish plan — run {run.run_id}")
    return plan


@flow(name="publish")
def publish_flow(config_path: str = "kiln.toml", out: str = "out", target: str | None = None,
                 channel: str = "nightly", dry_run: bool = False) -> Any:
    """Publish the run's wheels (from ``<out>/run.json``) to ``target``'s ``channel``."""
    run = open_run(out, "publish")
    store, plan = prepare_publish(run, config_path, out, target, channel, dry_run)
    uploads = [upload_wheel.submit(run, store, upload) for upload in plan.uploads]
    pages = publish_index_pages.submit(run, store, plan, [allow_failure(u) for u in uploads])
    pages.wait()
    return finish_stage(run, "publish", "Publish")


__all__ = ["index_prefix", "publish_flow"]
