"""Starting and continuing a run: its id, version, source state and record.

Plain functions (no Prefect): :mod:`kiln.flows.run.common` passes the Prefect
flow run id as the run id. The record lives in the artifact store named by
``[artifacts]`` in ``kiln.toml``; ``out`` is only where the local view of
the run goes (``<out>/<run-id>/``, with ``<out>/latest`` pointing at it).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kiln.core.errors import InvalidInputError
from kiln.core.objects import BotoSession
from kiln.core.record import RunHeader, RunRecord, create_record, open_record
from kiln.core.store import Store, open_store
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.source import describe
from kiln.tasks.run.versioning import check_build_version, nightly_version

log = logging.getLogger(__name__)


def artifact_store(config: KilnConfig, session: BotoSession | None = None) -> Store:
    """The artifact store of ``[artifacts]``; ``session`` carries the step's credentials (S3)."""
    target = config.artifacts
    return open_store(target.url, root=config.root, region=target.region, endpoint=target.endpoint,
                      expected_owner=target.expected_owner, session=session,
                      verifies_checksums=target.verifies_checksums, public=target.public)


def start_run(config: KilnConfig, store: Store, *, run_id: str, flow: str, out: str | Path,
              version: str | None = None, ref: str = "") -> RunRecord:
    """A new run's record: its version is ``version`` or the nightly version of the commit."""
    source = describe(config.root)
    if version is None:
        version = nightly_version(config.project.version, source.commit_time if source.in_git else None)
    check_build_version(version)
    config_rel = config.config_file.relative_to(config.root).as_posix()  # root is the file's own directory
    header = RunHeader(run_id=run_id, flow=flow, version=version, source=source, created=time.time(),
                       ref=ref or source.commit, config=config_rel)
    if source.unpublishable():
        log.warning("run %s cannot be published: %s", run_id, source.unpublishable())
    return create_record(store, header, out)


def continue_run(store: Store, run_id: str, out: str | Path) -> RunRecord:
    """The record of a run started earlier (``latest``: the newest that built wheels)."""
    return open_record(store, run_id, out)


def check_checkout(config: KilnConfig, commit: str) -> None:
    """A worker runs exactly the commit its run names: refuse a checkout at any other.

    ``commit`` is the run's, passed to every dispatched unit; "" (a run
    outside git, or a stage run by hand) checks nothing.
    """
    if not commit:
        return
    source = describe(config.root)
    if source.commit != commit or source.modified:
        found = source.commit[:12] if source.in_git else "not a git checkout"
        changed = f", with changes to {', '.join(source.modified[:5])}" if source.modified else ""
        raise InvalidInputError(f"the run names commit {commit[:12]}, but this worker's checkout {config.root} is at "
                                f"{found}{changed}; the deployment's git_clone step must check out the run's commit "
                                f"(KILN_COMMIT)")
