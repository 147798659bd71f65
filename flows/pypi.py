"""The release's uploads to PyPI-compatible indexes: the plan task, one upload task per file.

The release flow calls :func:`plan_uploads` beside its own publish plan (the
approver reads both; a refusal stops the release before anything moves) and
:func:`upload_release` after Kiln's own indexes are published and verified.
Each file is its own task run and ``publish/<target>/<file>`` unit: one
refused or failed upload does not stop the others, and only Kiln's retryable
errors (no answer, 5xx, throttling) are retried. The target's uploader reads
its credentials (an API token from its Prefect Secret block) or mints them
inside the upload task run, so they are never a task parameter, a log line or
a record entry.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from prefect import State, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from kiln.core.errors import ConfigError
from kiln.core.manifest import Unit
from kiln.core.record import RunRecord
from kiln.flows.publish import RETRY_DELAY_S, RETRY_JITTER, UPLOAD_RETRIES
from kiln.flows.run.common import markdown_report, record, retry_on_retryable, unit_from_state
from kiln.release.upload.pypi_release import PreparedUpload
from kiln.release.upload.twine import Endpoint, IndexCredentials, Outcome
from kiln.tasks import uploading
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.promotion import PROMOTED_INFO

UPLOAD_DIR = "pypi"  # under the run's view: the public-version wheels that are sent
SDIST_DIR = "sdist"  # under the run's view: the sdist an upload target ships
PLAN_KEY = "upload_plan"


def _prepare(config: KilnConfig, run: RunRecord, name: str, version: str) -> PreparedUpload:
    request = uploading.upload_request(config, run.manifest(), name, version)
    return uploading.uploader(config, name).plan(request, run.view / UPLOAD_DIR / name, datetime.now(UTC))


@task(name="plan-upload", cache_policy=NO_CACHE, retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable, task_run_name="plan upload to {name}")
def plan_upload_task(config: KilnConfig, run: RunRecord, name: str, version: str) -> tuple[str, list[str]]:
    """(the upload's plan as markdown, every file PyPI's rules refuse, with the reason)."""
    prepared = _prepare(config, run, name, version)
    markdown = prepared.plan.to_markdown()
    markdown_report(f"kiln-upload-plan-{name}", markdown, f"Upload plan for {name} — run {run.run_id}")
    return markdown, [f.reason for f in prepared.plan.refusals]


@task(name="build-sdist", cache_policy=NO_CACHE, task_run_name="build the sdist of {version}")
def build_sdist_task(config: KilnConfig, run: RunRecord, version: str) -> Path:
    """The project's sdist at the release's public version (kiln.tasks.build.sdist), under the run's view."""
    return uploading.build_release_sdist(config, version, run.view / SDIST_DIR)


def record_release_sdist(config: KilnConfig, run: RunRecord, version: str) -> str:
    """Build and record the sdist an upload target ships (the ``build/sdist`` unit and ``sdist`` artifact);
    why the release cannot have it, or "". A promotion builds none: its bytes are the nightly's, which had none."""
    wanted = uploading.sdist_wanted(config, run.manifest())
    if not wanted:
        return ""
    unit = Unit("build/sdist", "build", "skipped")
    if run.info().get(PROMOTED_INFO):
        record(run, Unit(unit.id, "build", "skipped", message=f"{wanted}, but a promoted release publishes the"
                         " nightly's bytes and the nightly built no sdist: none is uploaded"))
        return ""
    state = build_sdist_task(config, run, version, return_state=True)
    if not state.is_completed():
        record(run, unit_from_state(Unit(unit.id, "build", "failed"), state))
        return f"the sdist could not be built ({wanted}): {state.message}"
    path: Path = state.result()
    run.add_artifact(path, step="build", kind="sdist")
    record(run, Unit(unit.id, "build", "completed", message=path.name))
    return ""


def plan_uploads(config: KilnConfig, run: RunRecord, version: str) -> tuple[str, list[str]]:
    """(every upload target's plan as markdown, every refusal); the plan is also in the run's record. The sdist
    an upload target ships is built first, so the plan judges it like any file."""
    plans, refusals = [], []
    sdist = record_release_sdist(config, run, version)
    if sdist:
        refusals.append(sdist)
    for name in sorted(config.publish.upload_targets):
        state = plan_upload_task(config, run, name, version, return_state=True)
        if state.is_completed():
            markdown, refused = state.result()
            plans.append(markdown)
            refusals += [f"upload to {name} refused: {why}" for why in refused]
        else:
            refusals.append(f"the plan for {name} could not be made: {state.message}")
            plans.append(f"### Upload to `{name}`: NO PLAN\n\n{state.message}\n")
    markdown = "\n".join(plans)
    if markdown:
        run.set_info(PLAN_KEY, markdown)
    return markdown, refusals


@task(name="prepare-upload", cache_policy=NO_CACHE, retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable,
      task_run_name="prepare upload to {name}")
def prepare_upload_task(config: KilnConfig, run: RunRecord, name: str, version: str) -> PreparedUpload:
    """The plan made again just before sending: the index may have changed while the approver read it."""
    return _prepare(config, run, name, version)


def _secret(name: str) -> Callable[[str], str]:
    def read(block: str) -> str:
        from prefect.blocks.system import Secret

        try:
            return str(cast("Secret[str]", Secret.load(block)).get())  # sync code: the block, never a coroutine
        except ValueError as exc:
            raise ConfigError(f"publish.targets.{name}.token_block: no Prefect Secret block named {block!r}"
                              " (create it in the Prefect UI or with Secret(value=...).save())") from exc
    return read


def _credentials(config: KilnConfig, name: str) -> IndexCredentials:
    """Read (a Secret block) or minted by the target's uploader inside the upload task run, for that upload only."""
    return uploading.credentials(config, name, _secret(name))


@task(name="upload-to-index", cache_policy=NO_CACHE, retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable,
      task_run_name="upload {path.name} to {target.name}")
def upload_to_index(config: KilnConfig, target: Endpoint, path: Path) -> Outcome:
    """Check the index, send the file if it is not there, check the index lists it (idempotent on retry)."""
    return uploading.uploader(config, target.name).send(path, target, _credentials(config, target.name))


def _record_plan(run: RunRecord, name: str, prepared: PreparedUpload) -> None:
    for planned in prepared.plan.files:
        unit = f"publish/{name}/{planned.candidate.filename}"
        if planned.action == "skip":
            record(run, Unit(unit, "publish", "completed", message=planned.reason))
        elif planned.action == "refuse":
            record(run, Unit(unit, "publish", "failed", message=planned.reason))


def upload_to_target(config: KilnConfig, run: RunRecord, name: str, version: str) -> State:
    """Plan again, then one task run per file to send; a plan that cannot be made fails this target's unit."""
    state = prepare_upload_task(config, run, name, version, return_state=True)
    if not state.is_completed():
        record(run, unit_from_state(Unit(f"publish/{name}", "publish", "failed"), state))
        return Failed(message=f"upload to {name}: {state.message}")
    prepared: PreparedUpload = state.result()
    _record_plan(run, name, prepared)
    target = uploading.endpoint(config, name)
    to_send = prepared.to_send()
    failed = [f.reason for f in prepared.plan.refusals]
    wheels = [p for p in to_send if p.name.endswith(".whl")]
    failed += _send(config, run, target, wheels)
    sdists = [p for p in to_send if not p.name.endswith(".whl")]
    if failed:  # an sdist alone on the index would have pip build from source instead of installing the wheel
        for path in sdists:
            record(run, Unit(f"publish/{name}/{path.name}", "publish", "skipped",
                             message="not sent: a wheel of the release did not go up (an sdist alone would have pip"
                                     " build from source)"))
        sdists = []
    failed += _send(config, run, target, sdists)
    sent = len(wheels) + len(sdists)
    get_run_logger().info("upload to %s: %d sent, %d failed or refused", name, sent, len(failed))
    return Failed(message=f"upload to {name}: " + "; ".join(failed)) if failed else Completed(
        message=f"upload to {name}: {sent} files sent, {len(prepared.plan.files) - sent} skipped")


def _send(config: KilnConfig, run: RunRecord, target: Endpoint, paths: list[Path]) -> list[str]:
    """One upload task run per file, at once; each file's unit recorded; what failed, with the reason."""
    futures = [(path, upload_to_index.submit(config, target, path)) for path in paths]
    failed = []
    for path, future in futures:
        future.wait()
        unit = Unit(f"publish/{target.name}/{path.name}", "publish", "completed")
        if future.state.is_completed():
            outcome = future.state.result()
            record(run, Unit(unit.id, "publish", "completed", message="uploaded" if outcome == "added"
                             else "already on the index with the same sha256; nothing sent"))
        else:
            record(run, unit_from_state(Unit(unit.id, "publish", "failed"), future.state))
            failed.append(f"{path.name}: {future.state.message}")
    return failed


def upload_release(config: KilnConfig, run: RunRecord, version: str) -> list[State]:
    """Every upload target of the release, one after the other (each isolated from the others)."""
    return [upload_to_target(config, run, name, version) for name in sorted(config.publish.upload_targets)]
