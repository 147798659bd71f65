"""The release flow: validate → build → test → bench → approve → publish → verify.

Nothing is built before the version and channel are checked against what the
channel already holds. Publishing happens only after every stage passed (or a
recorded reason overrides benchmark regressions) and a person approved it in
the Prefect UI (or ``yes=True`` from the command line). If publishing or
verification fails, every index page the release changed is put back byte for
byte; the wheels stay, unreferenced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.states import Completed, Failed, State

from flows.bench import bench_flow
from flows.build import build_flow
from flows.common import markdown_report, open_run
from flows.credentials import session_for
from flows.publish import publish_flow
from flows.test import test_flow
from release.errors import KilnError
from release.verify import verify_published
from tasks import releasing
from tasks.config import load_config

Channel = Literal["release", "nightly"]
APPROVAL_TIMEOUT_S = 24 * 3600
APPROVAL_POLL_S = 5  # how soon an approval in the UI resumes the run
SNAPSHOT_DIR = "rollback"


class ApprovalInput(RunInput):
    """What the approver fills in in the Prefect UI."""

    approve: bool
    comment: str = ""


class ReleaseRejected(KilnError):
    """The approver said no; nothing was published."""


def _session(config: Any, channel: str) -> Any:
    """The channel publisher's own credentials; a local target needs none."""
    if config.publish.targets[config.publish.default_target].kind != "s3":
        return None
    return session_for(config, f"publish-{channel}")


def _store(config_path: str, out: str, channel: str) -> tuple[Any, str]:
    config = load_config(config_path)
    prefix = releasing.channel_prefix(config, channel)
    return releasing.open_target(config, out, _session(config, channel)), prefix


@task(name="validate-release")
def validate_release(config_path: str, out: str, version: str, channel: str) -> str:
    """PEP 440, unknown channel, already published, lower than the last: all refused here."""
    config = load_config(config_path)
    store, prefix = _store(config_path, out, channel)
    published = releasing.published_versions(store, prefix, config.project.distribution)
    return releasing.check_version(version, channel, published)


@task(name="release-gate")
def release_gate(stages: dict[str, tuple[str, str]], allow_regressions: str | None) -> str:
    return releasing.check_gate(stages, allow_regressions)


@task(name="snapshot-pages")
def snapshot_pages(config_path: str, out: str, channel: str) -> list[str]:
    store, prefix = _store(config_path, out, channel)
    return releasing.snapshot_pages(store, prefix, Path(out) / SNAPSHOT_DIR)


@task(name="verify-channel")
def verify_channel(config_path: str, out: str, channel: str) -> int:
    """Links, hashes, sidecars, then pip and uv installs from the served channel."""
    config = load_config(config_path)
    return len(verify_published(config, out, channel, session=_session(config, channel)))


@task(name="rollback-pages")
def rollback_pages(config_path: str, out: str, channel: str) -> dict[str, list[str]]:
    store, _ = _store(config_path, out, channel)
    return releasing.restore_pages(store, Path(out) / SNAPSHOT_DIR)


def _approve(version: str, channel: str, yes: bool) -> str:
    if yes:
        return "approved on the command line (--yes)"
    get_run_logger().info("waiting for approval of %s on %s in the Prefect UI", version, channel)
    answer = pause_flow_run(wait_for_input=ApprovalInput.with_initial_data(
        description=f"Publish {version} to the {channel} channel?", approve=False),
        timeout=APPROVAL_TIMEOUT_S, poll_interval=APPROVAL_POLL_S)
    if not answer.approve:
        raise ReleaseRejected(f"release {version} rejected by the approver: {answer.comment or 'no comment'}")
    return f"approved in the UI: {answer.comment or 'no comment'}"


def _state_of(state: State) -> tuple[str, str]:
    return state.type.value, state.message or ""


@flow(name="release")
def release_flow(version: str, ref: str = "HEAD", channel: Channel = "release", dry_run: bool = False,
                 allow_regressions: str | None = None, yes: bool = False, config_path: str = "kiln.toml",
                 out: str = "out/release") -> State:
    logger = get_run_logger()
    version = validate_release(config_path, out, version, channel)
    open_run(out, "release", version)
    logger.info("releasing %s (ref %s) to %s%s", version, ref, channel, " (dry run)" if dry_run else "")
    stages = {
        "build": build_flow(config_path=config_path, out=out, version=version, return_state=True),
        "test": test_flow(config_path=config_path, out=out, return_state=True),
        "bench": bench_flow(config_path=config_path, out=out, compare="last",
                            fail_on_regression=not allow_regressions, return_state=True),
    }
    gate = release_gate({name: _state_of(s) for name, s in stages.items()}, allow_regressions)
    approval = _approve(version, channel, yes)
    snapshot_pages(config_path, out, channel)
    published = publish_flow(config_path=config_path, out=out, channel=channel, dry_run=dry_run, return_state=True)
    verified = (verify_channel(config_path, out, channel, return_state=True)
                if published.is_completed() and not dry_run else published)
    summary = [f"release {version} (ref {ref}) → {channel}", gate, approval,
               f"publish: {_state_of(published)[0]}",
               f"verify: {'skipped (dry run: nothing was published)' if dry_run else _state_of(verified)[0]}"]
    if not verified.is_completed():
        rolled = rollback_pages(config_path, out, channel)
        summary.append(f"rolled back {len(rolled['restored'])} index pages")
        markdown_report("kiln-release-summary", "\n".join(f"- {line}" for line in summary), f"Release {version}")
        return Failed(message=f"release {version}: {_state_of(verified)[1] or 'publish/verify failed'}; "
                              f"index pages rolled back")
    markdown_report("kiln-release-summary", "\n".join(f"- {line}" for line in summary), f"Release {version}")
    return Completed(message=f"release {version} published to {channel}" + (" (dry run)" if dry_run else ""))
