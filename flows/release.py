"""The release flow: validate → build → test → bench → gate → plan → approve → publish → verify → upload.

With ``from_run`` (``kiln release --from-run RUN``) a completed nightly's tested
wheels are promoted under the release version instead of build, test and bench
(:mod:`kiln.flows.promote`); a run that cannot be promoted stops the release, named.

Nothing is built before the version and channel are checked against what the
channel already holds. Benchmarks are judged by the regression policy over
the window of stored nightlies on the same hardware (``[bench.regression]``;
``suspicious`` and ``insufficient data`` are reported, never blocking); a case
with too few such runs is compared with the last *published* release of the
channel (none yet: the gate says so and passes). Regressions block only on
``[bench] blocking_metrics`` (CPU timings are advisory) unless
``allow_regressions`` gives the reason. The approver sees the version, the
channel, whether it is a dry run and the publish plan (every file to add,
every page to change) before saying yes. If publishing or verification fails,
every index page the release changed is put back byte for byte; the wheels
stay, unreferenced. After a published release verifies, its benchmark results
become the channel's next baseline.

Two flows share one body: :func:`release_flow` (the ``release`` deployment and
``kiln release``) always pauses for approval in the Prefect UI, so the
deployment's Run form has no way to skip it; :func:`approved_release_flow` is
``kiln release --yes``, approved on the command line. Every way the release
stops — the gate, a rejection, a failed publish — ends the run Failed with a
clean message and the ``kiln-release-summary`` artifact, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from prefect import State, flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.states import Completed, Failed

from kiln.core import identity
from kiln.core.errors import ConfigError
from kiln.core.objects import BotoSession
from kiln.core.record import RunRecord
from kiln.flows.bench import bench_flow, store_release_baseline
from kiln.flows.promote import promote_run
from kiln.flows.publish import open_publish_target, project_statuses, publish_flow, publish_inputs
from kiln.flows.pypi import plan_uploads, upload_release
from kiln.flows.report.runname import current_release_name
from kiln.flows.report.summary import coverage_markdown
from kiln.flows.run.common import coverage_report, markdown_report, open_run, store_session, sync_state
from kiln.flows.run.dispatch import find_deployments
from kiln.flows.run.params import RunParams
from kiln.flows.run.stages import build_stage, start_suites, wait_suites
from kiln.flows.run.waiting import cancel_dispatched_on_exit
from kiln.flows.test import test_flow
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.release.read.verify import verify_published
from kiln.tasks import releasing, uploading
from kiln.tasks.project.config import Channel, KilnConfig, load_config
from kiln.tasks.run.runs import artifact_store

APPROVAL_TIMEOUT_S = 24 * 3600
APPROVAL_POLL_S = 5  # how soon an approval in the UI resumes the run
SNAPSHOT_DIR = "rollback"
SUMMARY_KEY = "kiln-release-summary"


class ApprovalInput(RunInput):
    """What the approver fills in in the Prefect UI."""

    approve: bool
    comment: str = ""


@dataclass
class Release:
    """One release's parameters and what it has said so far (the summary's lines)."""

    version: str
    ref: str
    channel: str
    dry_run: bool
    allow_regressions: str | None
    out: str
    config: KilnConfig  # loaded once, at the flow's entry; every task below takes it
    from_run: str | None = None  # promote this nightly's tested wheels instead of building (kiln.flows.promote)
    lines: list[str] = field(default_factory=list)
    plan: str = ""

    @property
    def title(self) -> str:
        return f"release {self.version} (ref {self.ref}) → {self.channel}" + (" (dry run)" if self.dry_run else "")


def _session(config: KilnConfig, channel: str) -> BotoSession | None:
    """The channel publisher's own credentials; a local target needs none."""
    return store_session(config, f"publish-{channel}", config.publish.targets[config.publish.default_target].kind)


def _store(config: KilnConfig, out: str, channel: str) -> tuple[Any, str]:
    prefix = releasing.channel_prefix(config, channel)
    return releasing.open_target(config, out, _session(config, channel)), prefix


@task(name="validate-release", cache_policy=NO_CACHE)
def validate_release(config: KilnConfig, out: str, version: str, channel: str, dry_run: bool = False) -> str:
    """PEP 440, unknown channel, already published, lower than the last, an upload target without a token or
    (Trusted Publishing) without an OIDC identity (a real release only): all refused here."""
    missing = [] if dry_run else uploading.missing_tokens(config)
    if missing:
        raise ConfigError("; ".join(missing))
    if not dry_run:
        uploading.check_identities(config)  # Trusted Publishing: an OIDC identity, or refused before the build
    store, prefix = _store(config, out, channel)
    published = releasing.published_versions(store, prefix, config.project.distribution)
    return releasing.check_release_version(
        version, channel, published, releasing.clean_commit(config.root),
        lambda: releasing.release_commits(artifact_store(config, _session(config, channel)), version))


@task(name="release-gate", cache_policy=NO_CACHE)
def release_gate(
    run: RunRecord, stages: dict[str, tuple[releasing.StateName, str]], allow_regressions: str | None
) -> str | State:
    """The gate's verdict; a stop is this task's Failed state with every reason, not a traceback."""
    not_run = [u.message for u in run.units() if u.stage == "bench" and u.state == "not_run" and u.message]
    decision = releasing.gate_decision(stages, run.info().get("bench_comparison"), allow_regressions,
                                       not_run[0] if not_run else "")
    for line in decision.lines:
        get_run_logger().info("gate: %s", line)
    return decision.message if decision.passed else Failed(message=decision.message)


@task(name="publish-plan", cache_policy=NO_CACHE)
def plan_publish(config: KilnConfig, run: RunRecord, channel: str, dry_run: bool) -> str:
    """What publishing would add and change, from the publish protocol run against a staging copy."""
    staging = open_publish_target(run, config, None, channel, dry_run=True)  # the target is only read
    extra, allowed = publish_inputs(run, config)
    variants, held = releasing.variants_to_publish(config, run.manifest())  # as publish_flow holds them back
    plan = publish(run.manifest(), staging, PublishRequest(
        channel, releasing.channel_prefix(config, channel), variants, extra=extra, untested_ok=allowed,
        statuses=project_statuses(config), indexes=releasing.publish_indexes(config), dry_run=True))
    plan.skipped.update(held)
    plan.dry_run, plan.preview = dry_run, not dry_run  # a real release's plan is a preview, not a dry run
    markdown = plan.to_markdown()
    markdown_report("kiln-release-plan", markdown, f"What the release would publish — run {run.run_id}")
    return markdown


@task(name="snapshot-pages", cache_policy=NO_CACHE)
def snapshot_pages(config: KilnConfig, out: str, channel: str, view: str) -> list[str]:
    store, prefix = _store(config, out, channel)
    return releasing.snapshot_pages(store, prefix, Path(view) / SNAPSHOT_DIR)


@task(name="verify-channel", cache_policy=NO_CACHE)
def verify_channel(config: KilnConfig, out: str, channel: str) -> int:
    """Links, hashes, sidecars, then pip and uv installs from the served channel."""
    store, prefix = _store(config, out, channel)
    indexes = releasing.publish_indexes(config)  # a matrix's cells are verified in their variant's one index
    return len(verify_published(store, prefix, sorted({indexes.get(v.name, v.name) for v in config.variants})))


@task(name="rollback-pages", cache_policy=NO_CACHE)
def rollback_pages(config: KilnConfig, out: str, channel: str, view: str) -> dict[str, list[str]]:
    store, _ = _store(config, out, channel)
    return releasing.restore_pages(store, Path(view) / SNAPSHOT_DIR)


def _approval_text(release: Release, run: RunRecord) -> str:
    """The description the approver reads in the Prefect UI's resume dialog."""
    kind = "**DRY RUN**: nothing is published; the plan runs against a staging copy" if release.dry_run \
        else "**real release**: the files below are published for good (published files are immutable)"
    return "\n".join([
        f"## Approve release `{release.version}` to the `{release.channel}` channel?", "",
        f"- version: `{release.version}` (ref `{release.ref}`, run `{run.run_id}`)",
        f"- channel: `{release.channel}`", f"- dry run: {'yes' if release.dry_run else 'no'} — {kind}",
        *(f"- {line}" for line in release.lines), "",
        "Set **approve** and resume to publish; resume with it unset to reject (nothing is published).", "",
        release.plan])


def _approve(release: Release, run: RunRecord) -> tuple[bool, str]:
    """(approved, the summary line): a pause in the Prefect UI with the plan as its description."""
    get_run_logger().info("waiting for approval of %s in the Prefect UI", release.title)
    initial = ApprovalInput.with_initial_data(description=_approval_text(release, run), approve=False)
    try:
        answer = pause_flow_run(wait_for_input=initial, timeout=APPROVAL_TIMEOUT_S, poll_interval=APPROVAL_POLL_S)
    except FlowPauseTimeout:
        return False, f"not approved within {APPROVAL_TIMEOUT_S // 3600} h: nothing was published"
    if not answer.approve:
        return False, f"rejected by the approver: {answer.comment or 'no comment'}; nothing was published"
    return True, f"approved in the UI: {answer.comment or 'no comment'}"


def _state_of(state: State) -> tuple[releasing.StateName, str]:
    return cast(releasing.StateName, state.type.value), state.message or ""


def _finish(release: Release, run: RunRecord | None, state: State) -> State:
    """Leave the release summary artifact (every ending has one), the run's local view, the final state."""
    coverage: list[str] = []
    if run is not None:
        coverage_report(release.config, run, "release")
        coverage = coverage_markdown(run.manifest())
        run.write_view()
    markdown = "\n".join([f"# {release.title[0].upper()}{release.title[1:]}", "",
                          *(f"- {line}" for line in release.lines), "", release.plan, *coverage]).rstrip() + "\n"
    markdown_report(SUMMARY_KEY, markdown, f"Release {release.version}")
    return state


def _stop(release: Release, run: RunRecord, why: str) -> State:
    get_run_logger().error("%s: %s", release.title, why)
    return _finish(release, run, Failed(message=f"release {release.version}: {why}"))


def _stages(release: Release, run: RunRecord) -> dict[str, State]:
    config = release.config
    params = RunParams.of(config, run, release.out)
    remote = find_deployments(config)  # builds and suites go to their pools when deployed, as in the nightly
    stages = {"build": build_stage(config, run, remote, params)}
    suites = start_suites(config, run, remote, params)
    stages["test"] = sync_state(test_flow(config_path=params.config_path, out=params.out, run_id=params.run_id,
                                          exclude=list(remote.suites), return_state=True))
    # Dry runs and failed releases never become a baseline: only a verified release is kept (below).
    stages["bench"] = sync_state(bench_flow(config_path=params.config_path, out=params.out, run_id=params.run_id,
                                 compare=f"published:{release.channel}", store_history=False,
                                 fail_on_regression=not release.allow_regressions,
                                 blocking_metrics=list(config.bench.blocking_metrics), return_state=True))
    wait_suites(config, run, remote, suites)
    return stages


def _promote(release: Release, run: RunRecord) -> dict[str, State]:
    """The stages of a promotion: the nightly's wheels under the release version; its tests stand."""
    promoted = sync_state(promote_run(release.config, run, str(release.from_run), release.version,
                                      return_state=True))
    release.lines.append(cast(str, promoted.result()) if promoted.is_completed() else
                         f"promotion of run {release.from_run} refused: {_state_of(promoted)[1]}")
    return {"promote": promoted}


def _publish_and_verify(release: Release, run: RunRecord) -> State:
    """Publish (or the dry run of it), verify, and roll the pages back if either failed."""
    params = RunParams.of(release.config, run, release.out)
    snapshot_pages(release.config, release.out, release.channel, str(run.view))
    published = sync_state(publish_flow(config_path=params.config_path, out=params.out, run_id=run.run_id,
                                        channel=release.channel, dry_run=release.dry_run, return_state=True))
    if release.dry_run:
        release.lines += [f"publish (dry run, staging copy): {_state_of(published)[0]}",
                          "verify: skipped (dry run: nothing was published)"]
        return published
    verified = (sync_state(verify_channel(release.config, release.out, release.channel, return_state=True))
                if published.is_completed() else published)
    release.lines += [f"publish: {_state_of(published)[0]}", f"verify: {_state_of(verified)[0]}"]
    if not verified.is_completed():
        rolled = rollback_pages(release.config, release.out, release.channel, str(run.view))
        release.lines.append(f"rolled back {len(rolled['restored'])} index pages")
        reason = _state_of(verified)[1] or "publish/verify failed"
        return Failed(message=f"{reason.splitlines()[0]}; index pages rolled back")
    kept = sync_state(store_release_baseline(release.config, run, release.channel, return_state=True))
    release.lines.append(kept.result() if kept.is_completed() else
                         f"benchmark baseline NOT kept: {_state_of(kept)[1]} (the release itself is published)")
    return verified


def _release(release: Release, approved_on_cli: bool) -> State:
    # A deployment's worker starts no kiln command: the flow holds the CI's identity itself, out of the
    # environment of everything the release starts, exposed only to the upload's exchange.
    with identity.kept():
        return _held_release(release, approved_on_cli)


def _held_release(release: Release, approved_on_cli: bool) -> State:
    release.version = validate_release(release.config, release.out, release.version, release.channel,
                                       release.dry_run)
    run = open_run(release.config, "release", release.out, version=release.version, ref=release.ref)
    get_run_logger().info("%s as run %s", release.title, run.run_id)
    release.lines.append(f"run `{run.run_id}`")
    with cancel_dispatched_on_exit(f"release {release.version}"):
        stages = _promote(release, run) if release.from_run else _stages(release, run)
    if "promote" in stages and not stages["promote"].is_completed():  # the run named is refused, by name
        return _stop(release, run, _state_of(stages["promote"])[1])
    gate = sync_state(release_gate(run, {name: _state_of(s) for name, s in stages.items()}, release.allow_regressions,
                                   return_state=True))
    release.lines += (cast(str, gate.result()) if gate.is_completed() else _state_of(gate)[1]).splitlines()
    if not gate.is_completed():
        return _stop(release, run, "stopped by the release gate before publishing (see the summary)")
    planned = sync_state(plan_publish(release.config, run, release.channel, release.dry_run, return_state=True))
    if not planned.is_completed():
        return _stop(release, run, f"the publish plan failed: {_state_of(planned)[1]}")
    release.plan = planned.result()
    uploads, refused = plan_uploads(release.config, run, release.version)  # PyPI-compatible indexes, if any
    release.plan += f"\n{uploads}" if uploads else ""
    if refused:
        return _stop(release, run, "the upload plan refuses files (nothing was published): " + "; ".join(refused))
    approved, line = (True, "approved on the command line (--yes)") if approved_on_cli else _approve(release, run)
    release.lines.append(line)
    if not approved:
        return _stop(release, run, line)
    final = _publish_and_verify(release, run)
    if not final.is_completed():
        return _stop(release, run, final.message or "publish failed")
    uploaded = [] if release.dry_run else upload_release(release.config, run, release.version)
    release.lines += [f"{state.message} ({_state_of(state)[0]})" for state in uploaded]
    failed = [state.message or "upload failed" for state in uploaded if not state.is_completed()]
    if failed:
        return _stop(release, run, "; ".join(failed))
    return _finish(release, run, Completed(message=f"release {release.version} published to {release.channel}"
                                              + (" (dry run)" if release.dry_run else "")))


@flow(name="release", flow_run_name=current_release_name)
def release_flow(version: str, ref: str = "HEAD", channel: Channel = "release", dry_run: bool = False,
                 allow_regressions: str | None = None, config_path: str = "kiln.toml",
                 out: str = "out/release", from_run: str | None = None) -> State:
    """Release ``version``: pauses for approval in the Prefect UI before anything is published.
    ``from_run``: publish that completed nightly's tested wheels under ``version`` instead of building."""
    return _release(Release(version, ref, channel, dry_run, allow_regressions, out, load_config(config_path),
                            from_run), False)


@flow(name="release", flow_run_name=current_release_name)
def approved_release_flow(version: str, ref: str = "HEAD", channel: Channel = "release", dry_run: bool = False,
                          allow_regressions: str | None = None, config_path: str = "kiln.toml",
                          out: str = "out/release", from_run: str | None = None) -> State:
    """``kiln release --yes``: the same release, approved on the command line (no deployment runs this)."""
    return _release(Release(version, ref, channel, dry_run, allow_regressions, out, load_config(config_path),
                            from_run), True)
