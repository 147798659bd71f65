"""The release's promotion stage (``kiln release --from-run RUN``): a nightly's tested wheels, not a rebuild.

One task run: the nightly's record is read from the artifact store, refused
when it did not complete or a wheel of it was not tested or published
(:func:`kiln.tasks.promotion.promotion_refusals`) or when the build ledger does
not vouch for a wheel of it (:func:`kiln.tasks.promotion.ledger_refusals`), and
each wheel is written under the release version with its binaries checked by hash. The release's
record gets the wheels as its build artifacts, the nightly's test units (the
bytes passed them, in that run), one ``promote/<variant>/<wheel>`` unit each,
and ``promoted_from``: the run it promoted.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from kiln.core.manifest import Unit
from kiln.core.record import RunRecord, open_record
from kiln.flows.run.common import record, store_session
from kiln.tasks import promotion
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.runs import artifact_store

PROMOTED_DIR = "wheels"  # under the release run's view, per variant, as a build leaves them


@task(name="promote-run", cache_policy=NO_CACHE, task_run_name="promote run {from_run} as {version}")
def promote_run(config: KilnConfig, run: RunRecord, from_run: str, version: str) -> str:
    """Promote ``from_run``'s wheels into ``run`` under ``version``; the summary line."""
    store = artifact_store(config, store_session(config, "build", config.artifacts.kind, read_only=True))
    source = open_record(store, from_run, run.view.parent)
    nightly = source.manifest()
    promoted = promotion.promote(nightly, version, run.view / PROMOTED_DIR, ledger=store,
                                 built_from=source.header.source)
    run.add_artifacts((p.path, "build", p.kind, p.variant) for p in promoted)
    run.record_all(promotion.inherited_units(nightly, {p.variant for p in promoted}))
    for p in promoted:
        record(run, Unit(f"promote/{p.variant}/{p.path.name}", "build", "completed", variant=p.variant,
                         message=f"promoted from nightly run {nightly.run_id}: {p.source} (sha256"
                                 f" {p.source_sha256}); every binary identical"))
    run.set_info(promotion.PROMOTED_INFO, promotion.promotion_info(nightly, promoted))
    variant_wheels = sum(1 for p in promoted if p.kind == "variant-wheel")
    line = (f"promoted nightly run {nightly.run_id} ({nightly.version}): {len(promoted) - variant_wheels} wheels"
            f" and {variant_wheels} variant wheels under {version}, binaries identical (not rebuilt)")
    get_run_logger().info(line)
    return line
