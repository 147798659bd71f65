"""The publish stage as a flow: one task run per wheel upload, then the pages.

The protocol itself (order, verification, merging, CAS) is
:func:`kiln.release.publish.protocol.publish`, the same call the crash and race tests
drive; this module hands it upload and pages steps that run as Prefect tasks,
so the UI shows which upload failed, retries what is retryable, and leaves
the plan and the index link as an artifact.
"""

from __future__ import annotations

import contextvars
import logging
import tempfile
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.results import ResultStore, get_result_store

from kiln.core.errors import IMMUTABLE_HINT, ConfigError, IntegrityError, PermanentError
from kiln.core.manifest import RunManifest, Unit
from kiln.core.record import RunRecord
from kiln.core.store import Store
from kiln.flows.report.runname import current_step_name, name_this_run, run_name
from kiln.flows.run.common import (
    finish_stage,
    markdown_report,
    open_run,
    record,
    retry_on_retryable,
    store_session,
    unit_from_state,
)
from kiln.release.index.pins import fetch_pins, load_pins
from kiln.release.index.render import ProjectStatus
from kiln.release.publish.closure import ClosureQuery, ClosureResult, prefetch, resolve_shared, unique_queries
from kiln.release.publish.pages import PAGE_CACHE, page_cache, page_max_age, publish_pages
from kiln.release.publish.plan import (
    COMBINED,
    ClosureStep,
    Plan,
    Upload,
    UploadResult,
    closure_queries,
    collect,
    index_prefix,
)
from kiln.release.publish.protocol import (
    DependencyCheck,
    PagesStep,
    PublishRequest,
    PublishSteps,
    UploadStep,
    publish,
    upload_file,
)
from kiln.release.read.public import PublicReport, check_public, published_expectations
from kiln.release.stores.staging import StagingStore
from kiln.tasks import releasing
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel

UPLOAD_RETRIES = 3
RETRY_DELAY_S = 5
RETRY_JITTER = 1.0  # delays spread over about 0-10 s (mean 5 s), so retrying publishers do not collide
DEPENDENCY_CACHE = timedelta(hours=12)
STAGING_DIR = "publish-staging"
PINS_DIR = "pins"
RUNTIME_DIR = "runtime"

log = logging.getLogger(__name__)


def refusal(run: RunRecord, dry_run: bool) -> str:
    """Why this run may not be published (a dry run may always go ahead), or ""."""
    why = run.header.source.unpublishable()
    return "" if dry_run or not why else f"run {run.run_id} is not published: {why}"


def project_statuses(config: KilnConfig) -> dict[str, ProjectStatus]:
    """The PEP 792 status of the project's pages (kiln.toml [project] status); every other project is active."""
    return {canonicalize_name(config.project.distribution): config.project.page_status}


def open_publish_target(run: RunRecord, config: KilnConfig, target: str | None, channel: str,
                        dry_run: bool) -> Store:
    """The target's store, or for a dry run a staging copy of it under the run's view."""
    name = target or config.publish.default_target
    if name not in config.publish.targets:
        raise ConfigError(f"unknown publish target {name!r}; kiln.toml defines {sorted(config.publish.targets)}")
    # {out} in a file:// target is the --out directory (every run's view lives under it).
    session = store_session(config, f"publish-{channel}", config.publish.targets[name].kind)
    store = releasing.open_target(config, str(run.view.parent), session, name)
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
    return extra, releasing.untested_ok(config)


@task(name="prepare-publish", cache_policy=NO_CACHE)
def prepare_publish(run: RunRecord, config: KilnConfig, target: str | None, channel: str,
                    dry_run: bool) -> tuple[Store, list[tuple[str | None, Path]], list[str]]:
    """Open the target (or its staging copy) and fetch what is published beside the wheels."""
    store = open_publish_target(run, config, target, channel, dry_run)
    extra, allowed = publish_inputs(run, config)
    return store, extra, allowed


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
    if channel == "release":  # the store's message ends with the hint already (AlreadyPublishedError.held)
        return result.message if IMMUTABLE_HINT in result.message else f"{result.message}; {IMMUTABLE_HINT}"
    return (f"{result.message}; this build has sha256 {result.upload.dist.sha256}. A nightly version names its "
            f"commit and two builds of one clean commit are byte-identical, so the bytes changed without a new "
            f"commit: the toolchain (Triton, nvcc) or a build input outside git changed — compare the two wheels' "
            f"RECORD files, and commit the change that explains it")


@task(name="publish-pages", retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      retry_jitter_factor=RETRY_JITTER, retry_condition_fn=retry_on_retryable, cache_policy=NO_CACHE)
def publish_index_pages(store: Store, results: list[UploadResult], cache_control: str = PAGE_CACHE) -> list[str]:
    """Project pages then root, for the files whose upload verified."""
    return publish_pages(store, results, cache_control)


def upload_tasks(run: RunRecord, channel: str) -> UploadStep:
    """The upload step as one task run per wheel; each records its unit, failed ones with Prefect's reason."""
    def upload(store: Store, uploads: Sequence[Upload]) -> list[UploadResult]:
        futures = [(u, upload_wheel.submit(store, u, channel)) for u in uploads]
        results: list[UploadResult] = []
        for item, future in futures:
            future.wait()
            value = future.state.result(raise_on_failure=False) if future.state.is_completed() else None
            if isinstance(value, UploadResult):
                results.append(value)
                record(run, Unit(item.unit_id, "publish", "completed", variant=item.variant,
                                 message="added" if value.outcome == "added" else "already present"))
            else:  # the unit says what Prefect says: failed, with the reason
                record(run, unit_from_state(Unit(item.unit_id, "publish", "failed", variant=item.variant),
                                            future.state))
        return results
    return upload


class UnresolvedDependencies(PermanentError):
    """A variant's wheel would not install with its dependencies; carries pip's answer."""

    def __init__(self, message: str, result: ClosureResult) -> None:
        super().__init__(message)
        self.result = result


# The same requirements from the same indexes give the same answer for a while: nightly after nightly
# asks it again (kiln.release.publish.closure). Only an answer that resolved is kept; a refusal is asked again.
@task(name="check-dependencies", cache_key_fn=lambda _, params: params["query"].cache_key,
      cache_expiration=DEPENDENCY_CACHE, task_run_name="dependencies of {query.requirement} ({query.variant})",
      retries=UPLOAD_RETRIES, retry_delay_seconds=RETRY_DELAY_S, retry_jitter_factor=RETRY_JITTER,
      retry_condition_fn=retry_on_retryable)  # an index that did not answer, a full disk: asked again
def check_dependencies(query: ClosureQuery) -> ClosureResult:
    result = resolve_shared(query)  # a nightly started it after its build (start_dependency_checks)
    if not result.ok:
        raise UnresolvedDependencies(result.describe(query), result)
    return result


def closure_task(run: RunRecord, refuse: bool = True) -> ClosureStep:
    """The dependency checks as task runs at once, each answer as the publish/dependencies/<variant> unit
    (failed when it refuses the variant; with ``refuse`` False a warning on a completed unit)."""
    def step(queries: Sequence[ClosureQuery]) -> list[ClosureResult]:
        # one task run per distinct question: two variants whose wheels ask the same are resolved once
        futures = {key: check_dependencies.submit(query) for key, query in unique_queries(queries).items()}
        return [_answer(run, query, futures[query.cache_key], refuse) for query in queries]
    return step


def _answer(run: RunRecord, query: ClosureQuery, future: PrefectFuture[Any], refuse: bool) -> ClosureResult:
    future.wait()
    state = future.state
    answer = state.result(raise_on_failure=False)
    result = answer if isinstance(answer, ClosureResult) else getattr(answer, "result", None)
    if not isinstance(result, ClosureResult):
        result = ClosureResult(False, "", f"the check did not finish: {state.message}")
    cached = " (answered by an identical check within the last 12 h)" if state.name == "Cached" else ""
    warning = "" if result.ok or refuse else "WARNING, published anyway ([publish] check_dependencies = warn): "
    record(run, Unit(f"publish/dependencies/{query.variant}", "publish",
                     "completed" if result.ok or not refuse else "failed", variant=query.variant,
                     message=warning + result.describe(query) + cached))
    return result


def early_queries(run: RunRecord, manifest: RunManifest, config: KilnConfig, channel: str) -> list[ClosureQuery]:
    """The dependency questions the publish of ``run`` to ``channel``'s default target will ask, from the
    ``manifest`` its build left: the uploads :func:`publish_flow` collects (before any test gates a variant)."""
    extra, allowed = publish_inputs(run, config)
    variants, _ = releasing.variants_to_publish(config, manifest)
    uploads, _ = collect(manifest, releasing.channel_prefix(config, channel), variants, extra=extra,
                         untested_ok=allowed, commit=publish_commit(run, channel), statuses=project_statuses(config),
                         indexes=releasing.publish_indexes(config))
    return closure_queries(uploads, config.publish.extra_index_urls)


def answered_by_cache(query: ClosureQuery) -> bool:
    """Whether :func:`check_dependencies` holds an answer to ``query`` in Prefect's cache (its run would be Cached,
    asking nothing: not worth a pip beside the tests)."""
    store = get_result_store().update_for_task(check_dependencies)  # sync here: no event loop on this thread
    return isinstance(store, ResultStore) and store.exists(query.cache_key)


def start_dependency_checks(run: RunRecord, config: KilnConfig, channel: str = "nightly") -> None:
    """Start the publish stage's dependency checks in the background, now that the wheels are built
    (:func:`kiln.release.publish.closure.prefetch`): :func:`check_dependencies` takes their answers. Never fails, never
    changes the run: what goes wrong here is logged, and the publish stage then resolves as it would have."""
    try:
        if config.publish.check_dependencies == "off" or refusal(run, dry_run=False):
            return
        manifest = run.manifest()  # read here, before the tests add to the record
    except Exception as exc:  # as in start()
        log.info("dependency checks not started early: %s", exc)
        return

    def start() -> None:
        try:
            if config.publish.pins and load_pins(config.path(config.publish.pins)):
                log.debug("dependency checks not started early: the pinned wheels would be downloaded twice")
                return
            prefetch([q for q in early_queries(run, manifest, config, channel) if not answered_by_cache(q)])
        except Exception as exc:  # the publish stage asks itself, and meets any real error there
            log.info("dependency checks not started early: %s", exc)

    threading.Thread(target=contextvars.copy_context().run, args=(start,), name="kiln-early-closure",
                     daemon=True).start()


def dependency_check(run: RunRecord, config: KilnConfig) -> DependencyCheck | None:
    """The publish's dependency check as ``[publish] check_dependencies`` asks for it (``off``: none)."""
    check = config.publish.check_dependencies
    if check == "off":
        return None
    refuse = check == "refuse"
    return DependencyCheck(closure_task(run, refuse=refuse), config.publish.extra_index_urls, refuses=refuse)


def pages_task(run: RunRecord, channel: str) -> PagesStep:
    """The pages step as its task run (pages cached as ``channel``'s, :func:`~kiln.release.publish.pages.page_cache`);
    a failure is the publish/pages unit's, and no page changed."""
    def pages(store: Store, results: list[UploadResult]) -> list[str]:
        future = publish_index_pages.submit(store, results, page_cache(channel))
        future.wait()
        changed = future.state.result(raise_on_failure=False) if future.state.is_completed() else None
        if not isinstance(changed, list):
            record(run, unit_from_state(Unit("publish/pages", "publish", "failed"), future.state))
            return []
        record(run, Unit("publish/pages", "publish", "completed", message=f"{len(changed)} pages changed"))
        return changed
    return pages


def commit_install_facts(plan: Plan, install: dict[str, Any]) -> dict[str, Any]:
    """The install facts of each per-commit index: those of its variant's channel index, which it mirrors."""
    indexes = dict(install.get("indexes") or {})
    channel_of = {u.commit_index: u.index for u in plan.uploads if u.commit_index}
    for commit_index in plan.commit_indexes:
        facts = indexes.get(f"{plan.target}/{channel_of.get(commit_index, '')}/")
        if isinstance(facts, dict):
            indexes[f"{plan.target}/{commit_index}/"] = facts
    return {**install, "indexes": indexes}


def report_plan(run: RunRecord, config: KilnConfig, plan: Plan) -> None:
    """Skipped variants as units; the plan, index links and install hint in the record and as an artifact."""
    for variant, why in plan.skipped.items():
        record(run, Unit(f"publish/{variant}", "publish", "skipped", variant=variant, message=why))
    for key, why in sorted(plan.frozen.items()):  # a new file of an archived project: not uploaded, said
        record(run, Unit(f"publish/{key}", "publish", "skipped", variant=key.split("/", 1)[0], message=why))
    for project, why in sorted(plan.variants_refused.items()):  # a conflicting variant label: this unit fails
        record(run, Unit(f"publish/{COMBINED}/{project}", "publish", "failed", message=why))
    facts = releasing.publish_facts(config, run.manifest(), plan)
    if isinstance(facts.get("install"), dict):
        facts["install"] = commit_install_facts(plan, facts["install"])
    for key, value in facts.items():
        run.set_info(key, value)
    indexes = sorted({f"{plan.target}/{u.index}/" for u in plan.uploads})
    commits = plan.commit_index_urls()
    run.set_info("index_url" if not plan.dry_run else "dry_run_index_url", indexes)
    run.set_info("commit_index_url" if not plan.dry_run else "dry_run_commit_index_url", commits)
    run.set_info("publish_plan", plan.to_markdown())
    if not plan.dry_run:
        run.set_info("published_uninstallable", plan.uninstallable)
    for url in commits:
        get_run_logger().info("per-commit index (this commit's wheels only): %s", url)
    links = "\n".join([*(f"- index: <{url}>" for url in indexes),
                       *(f"- this commit's index: <{url}>" for url in commits)]) or "- no index changed"
    markdown_report("kiln-publish-plan", plan.to_markdown() + "\n" + links + "\n", f"Publish plan — run {run.run_id}")


@task(name="verify-public-url", cache_policy=NO_CACHE, task_run_name="verify through {public_url}")
def verify_public_url(store: Store, plan: Plan, public_url: str) -> PublicReport:
    """Every new file and changed page downloaded through the CDN in front of the target, by hash; a changed
    page may take its channel's max-age to show there (kiln.release.read.public.check_public)."""
    return check_public(public_url, published_expectations(store, plan), page_grace_s=page_max_age(plan.channel))


def check_public_url(run: RunRecord, config: KilnConfig, target: str | None, store: Store, plan: Plan) -> None:
    """The publish/public-url unit: what users download through the target's public_url is what was published
    (a target without one, or a dry run, has nothing to check)."""
    public_url = config.publish.targets[target or config.publish.default_target].public_url
    if public_url is None or plan.dry_run:
        return
    state = verify_public_url(store, plan, public_url, return_state=True)
    report = state.result(raise_on_failure=False) if state.is_completed() else None
    if not isinstance(report, PublicReport):
        record(run, unit_from_state(Unit("publish/public-url", "publish", "failed"), state))
        return
    record(run, Unit("publish/public-url", "publish", "completed" if report.ok else "failed",
                     message=report.summary()))


def publish_commit(run: RunRecord, channel: str) -> str:
    """The commit whose per-commit index a publish writes: a clean tree's, in every channel but ``release``."""
    source = run.header.source
    return source.commit if channel != "release" and source.clean and source.commit else ""


@flow(name="publish", flow_run_name=current_step_name("publish"))
def publish_flow(config_path: str = "kiln.toml", out: str = "out", target: str | None = None,
                 channel: str = "nightly", dry_run: bool = False, run_id: str = "latest", commit: str = "") -> Any:
    """Publish the wheels of run ``run_id`` (``latest``: the newest that built wheels) to ``target``'s ``channel``.

    ``commit``: the commit the run names, which this checkout must be at (publishing dispatched to a worker).
    """
    config = load_config(config_path)
    run = open_run(config, "publish", out, run_id=run_id, step=f"publish-{channel}", commit=commit)
    name_this_run(run_name("publish", run, f"{channel} {run.header.version}" + (" (dry run)" if dry_run else "")))
    why = refusal(run, dry_run)
    if why:
        record(run, Unit("publish/source", "publish", "failed", message=why))
        return finish_stage(run, "publish", "Publish")
    store, extra, allowed = prepare_publish(run, config, target, channel, dry_run)
    variants, held = releasing.variants_to_publish(config, run.manifest())  # [publish] publish_untested
    request = PublishRequest(channel, releasing.channel_prefix(config, channel), variants, extra=extra,
                             untested_ok=allowed, commit=publish_commit(run, channel),
                             statuses=project_statuses(config), indexes=releasing.publish_indexes(config),
                             dry_run=dry_run)
    steps = PublishSteps(upload=upload_tasks(run, channel), pages=pages_task(run, channel),
                         dependencies=dependency_check(run, config))
    plan = publish(run.manifest(), store, request, steps)
    plan.skipped.update(held)
    report_plan(run, config, plan)
    check_public_url(run, config, target, store, plan)
    return finish_stage(run, "publish", "Publish")


__all__ = ["index_prefix", "publish_flow", "start_dependency_checks"]
