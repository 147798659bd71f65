"""``kiln prune``: the retention of a nightly channel as a flow (and the ``prune`` deployment's schedule).

The work is :func:`kiln.release.publish.prune.prune`; this flow opens the target with
the ``prune-<channel>`` step's own credentials (the only step whose policy
allows deleting, and only under its channel's prefix), names the run, and
leaves the plan as a markdown artifact the UI shows.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from kiln.core.errors import ConfigError, InvalidInputError
from kiln.flows.report.runname import name_this_run
from kiln.flows.run.common import markdown_report, store_session
from kiln.release.publish.prune import PrunePlan, Retention, open_for_prune, prune
from kiln.tasks import releasing
from kiln.tasks.project.config import KilnConfig, load_config


def run_prune(config: KilnConfig, *, channel: str, target: str | None, dry_run: bool, out: str = "out") -> PrunePlan:
    """Prune ``channel`` of ``target`` (default: the default target) under ``[publish.retention]``."""
    if channel == "release":
        raise InvalidInputError("kiln prune --channel release: releases are never pruned (only nightly channels)")
    name = target or config.publish.default_target
    if name not in config.publish.targets:
        raise ConfigError(f"unknown publish target {name!r}; kiln.toml defines {sorted(config.publish.targets)}")
    session = store_session(config, f"prune-{channel}", config.publish.targets[name].kind)
    store = open_for_prune(releasing.open_target(config, out, session, name))
    retention = Retention(config.publish.retention.keep, config.publish.retention.grace_days)
    return prune(store, channel=channel, channel_prefix=releasing.channel_prefix(config, channel),
                 release_prefix=releasing.channel_prefix(config, "release"), retention=retention, dry_run=dry_run)


@flow(name="prune", flow_run_name="prune {channel}")
def prune_flow(config_path: str = "kiln.toml", channel: str = "nightly", target: str | None = None,
               dry_run: bool = False, out: str = "out") -> str:
    """Yank the nightlies older than the newest ``keep``; remove those yanked ``grace_days`` ago."""
    config = load_config(config_path)
    name_this_run(f"prune {channel}" + (" (dry run)" if dry_run else ""))
    plan = run_prune(config, channel=channel, target=target, dry_run=dry_run, out=out)
    report = plan.to_markdown()
    get_run_logger().info("%s", report)
    markdown_report("kiln-prune-plan", report, f"Prune of {channel}" + (" (dry run)" if dry_run else ""))
    return report


__all__ = ["prune_flow", "run_prune"]
