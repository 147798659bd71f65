"""The publish stage as a flow: one task run per wheel upload, then the pages.

The protocol itself (order, verification, merging, CAS) is
:mod:`kiln.release.publish`; this module only orders it into Prefect tasks so the
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

from kiln.flows.common import finish_stage, markdown_report, open_run, record, retry_on_retryable, unit_from_state
from kiln.release.errors import ConfigError, IntegrityError
from kiln.release.manifest import Unit
from kiln.release.record import RunRecord
from kiln.release.pins import fetch_pins, load_pins
from kiln.release.publish import Plan, Upload, UploadResult, collect, index_prefix, publish_pages, untested, upload_file
from kiln.release.staging import StagingStore
from kiln.release.store import Store
from kiln.tasks import releasing
from kiln.tasks.build.runtime_wheel import build_runtime_wheel
from kiln.tasks.config import KilnConfig, load_config

UPLOAD_RETRIES = 3
RETRY_DELAY_S = 5
RETRY_JITTER = 1.0  # delays spread over about 0-10 s (mean 5 s), so retrying publishers do not collide
STAGING_DIR = "publish-staging"
PINS_DIR = "pins"
RUNTIME_DIR = "runtime"


def _session(config: Any, channel: str, target: str) -> Any:
    """Credentials of the publish step for this channel (one line to swap per credential source)."""
    if config.publish.targets[target].kind != "s3":
        return None
    from kiln.flows.credentials import session_for

    return session_for(config, f"publish-{channel}")


def refusal(run: RunRecord, dry_run: bool) -> str:
    """Why this run may not be published (a dry run may always go ahead), or ""."""
    why = run.header.source.unpublishable()
    return "" if dry_run or not why else f"run {run.run_id} is not published: {why}"


def open_publish_target(run: RunRecord, config: KilnConfig, target: str | None, channel: str,
                        dry_run: bool) -> Store:
    """The target's store, or for a dry run a staging copy of it under the run's view."""
    name = target or config.publish.default_target
    if name not in config.publish.targets:
        raise ConfigError(f"unknown publish target {name!r}; kiln.toml defines {sorted(config.publish.targets)}")
    # {out} in a file:// target is the --out directory (every run's view lives under it).
    store = releasing.open_target(config, str(run.view.parent), _session(config, channel, name), name)
    if not dry_run:
        return store
    staging = run.view / STAGING_DIR
    staging.mkdir(parents=True, exist_ok=True)
    return StagingStore(store, Path(tempfile.mkdtemp(dir=staging)))


def publish_inputs(run: RunRecord, config: KilnConfig) -> tuple[list[tuple[str | None, Path]], list[str]]:
    """The files published beside the wheels (pins, kiln-runtime), and the suites whose variants may go out untested."""
    pins = load_pins(config.path(config.publish.pins)) if config.publish.pins else []
    extra = fetch_pins(pins, run.view / PINS_DIR)
    if config.project.ships_runtime:  # the package imports kiln.runtime: its wheel goes in every index
        extra.append((None, build_runtime_wheel(run.view / RUNTIME_DIR)))
    return extra, [s.name for s in config.suites if s.publish_untested]


@task(name="prepare-publish", cache_policy=NO_CACHE)
def prepare_publish(run: RunRecord, config: KilnConfig, target: str | None, channel: str,
                    dry_run: bool) -> tuple[Store, Plan]:
    """Open the target (or its staging copy), verify every file against the record, gate variants."""
    prefix = releasing.channel_prefix(config, channel)
    store = open_publish_target(run, config, target, channel, dry_run)
    extra, allowed = publish_inputs(run, config)
    manifest = run.manifest()
    uploads, skipped = collect(manifest, prefix, [v.name for v in config.variants], time.time, extra, allowed)
    for variant, why in skipped.items():
        record(run, Unit(f"publish/{variant}", "publish", "skipped", variant=variant, message=why))
    published = sorted({u.variant for u in uploads})
    run.set_info("published_untested", {v: why for v, why in untested(manifest, published).items()})
    return store, Plan(store.url, channel, uploads, skipped, dry_run=dry_run)


# A single delay with jitter, not a list: the Prefect UI shows a list of delays as "NaNs".
@task(name="upload-wheel", retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable, cache_policy=NO_CACHE,
      task_run_name="upload {upload.variant}/{upload.dist.filename}")
def upload_wheel(store: Store, upload: Upload, channel: str) -> UploadResult:
    """Wheel, then sidecar, both verified; a conflict fails this unit only."""
    result = upload_file(store, upload)
    if result.outcome == "conflict":
        raise IntegrityError(conflict_message(result, channel))
    return result


def conflict_message(result: UploadResult, channel: str) -> str:
    """Why the same file name with other bytes is an error, and what to do."""
    if channel == "release":
        return f"{result.message}; published files are immutable — bump the version instead"
    return (f"{result.message}; this build has sha256 {result.upload.dist.sha256}. A nightly version names its "
            f"commit and two builds of one clean commit are byte-identical, so the bytes changed without a new "
            f"commit: the toolchain (Triton, nvcc) or a build input outside git changed — compare the two wheels' "
            f"RECORD files, and commit the change that explains it")


@task(name="publish-pages", retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable, cache_policy=NO_CACHE)
def publish_index_pages(run: RunRecord, store: Store, plan: Plan, results: list[Any],
                        config: KilnConfig) -> Plan:
    """Project pages then root, for the files whose upload verified; the plan and install hint as artifacts."""
    plan.results = [r for r in results if isinstance(r, UploadResult)]
    plan.pages = publish_pages(store, plan.results)
    indexes = sorted({f"{store.url}/{u.index}/" for u in plan.uploads})
    run.set_info("index_url" if not plan.dry_run else "dry_run_index_url", indexes)
    run.set_info("publish_plan", plan.to_markdown())
    run.set_info("install", releasing.install_info(config))
    links = "\n".join(f"- index: <{url}>" for url in indexes) or "- no index changed"
    markdown_report("kiln-publish-plan", plan.to_markdown() + "\n" + links + "\n", f"Publish plan — run {run.run_id}")
    return plan


@flow(name="publish")
def publish_flow(config_path: str = "kiln.toml", out: str = "out", target: str | None = None,
                 channel: str = "nightly", dry_run: bool = False, run_id: str = "latest") -> Any:
    """Publish the wheels of run ``run_id`` (``latest``: the newest that built wheels) to ``target``'s ``channel``."""
    config = load_config(config_path)
    run = open_run(config, "publish", out, run_id=run_id, step=f"publish-{channel}")
    why = refusal(run, dry_run)
    if why:
        record(run, Unit("publish/source", "publish", "failed", message=why))
        return finish_stage(run, "publish", "Publish")
    store, plan = prepare_publish(run, config, target, channel, dry_run)
    futures = [(u, upload_wheel.submit(store, u, channel)) for u in plan.uploads]
    results: list[Any] = []
    for upload, future in futures:
        future.wait()
        value = future.state.result(raise_on_failure=False) if future.state.is_completed() else None
        if isinstance(value, UploadResult):
            results.append(value)
            record(run, Unit(upload.unit_id, "publish", "completed", variant=upload.variant,
                             message="added" if value.outcome == "added" else "already present"))
        else:  # the unit says what Prefect says: failed, with the reason
            record(run, unit_from_state(Unit(upload.unit_id, "publish", "failed", variant=upload.variant),
                                        future.state))
    pages = publish_index_pages.submit(run, store, plan, results, config)
    pages.wait()
    plan_done = pages.state.result(raise_on_failure=False) if pages.state.is_completed() else None
    record(run, unit_from_state(Unit("publish/pages", "publish", "failed"), pages.state)
           if plan_done is None else Unit("publish/pages", "publish", "completed",
                                          message=f"{len(plan_done.pages)} pages changed"))
    return finish_stage(run, "publish", "Publish")


__all__ = ["index_prefix", "publish_flow"]
