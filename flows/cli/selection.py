"""``kiln test --explain`` and ``kiln test --selection-on``: test selection's records read, nothing run.

No flow run: they read (and, for ``--selection-on``, write) what the test stage keeps under
``[testing.quarantine] history``/selection/ (:mod:`kiln.tasks.testing.selection`), with the test step's
credentials on S3. ``--explain`` judges the wheels of an existing run (``--run``, default the newest that built
wheels) against each suite unit's newest record.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kiln.core.errors import InvalidInputError
from kiln.core.record import open_record
from kiln.flows.run.common import store_session
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.runs import artifact_store
from kiln.tasks.testing import selection, selection_store
from kiln.tasks.testing.suite import targets


def explain_selection(config: KilnConfig, suites: list[str] | None, run_id: str | None, out: str,
                      full: bool = False) -> str:
    store = artifact_store(config, store_session(config, "test", config.artifacts.kind))
    run = open_record(store, run_id or "latest", out)
    wheels = {a.variant: a for a in run.artifacts() if a.kind == "wheel" and a.variant}
    unknown = sorted(set(suites or ()) - set(config.suites_by_name))
    if unknown:
        raise InvalidInputError(f"no suite named {unknown} in {config.config_file}")
    chosen = [s for s in config.suites if not suites or s.name in suites]
    lines = [f"test selection against the wheels of run {run.run_id}"]
    # One explanation per suite unit: a sharded suite's shards share its records.
    whole = {t.suite_unit_id: replace(t, shard=0, shards=1) for t in targets(config, chosen)}
    for target in whole.values():
        artifact = wheels.get(target.variant.name)
        if artifact is None:
            lines.append(f"{target.unit_id}: run {run.run_id} has no {target.variant.name} wheel")
            continue
        selector = selection.selector_for(config, store, suite=target.suite.name, gpus=target.suite.gpus,
                                          unit_id=target.unit_id, unit_name=target.name,
                                          folder=target.suite_name, run_id="", created=run.header.created,
                                          flow="test", full=full)  # run_id "": the newest records, whichever run
        lines += selection.explain_unit(selector, run.fetch(artifact), Path(config.root))
    return "\n".join(lines) + "\n"


def selection_on(config: KilnConfig, suite: str) -> str:
    """Turn selection back on for ``suite`` after a recall miss turned it off."""
    if suite not in config.suites_by_name:
        raise InvalidInputError(f"no suite named {suite!r} in {config.config_file}")
    store = artifact_store(config, store_session(config, "test", config.artifacts.kind))
    history = config.testing.quarantine
    was = selection_store.switched_off(store, history, suite)
    selection_store.switch(store, history, suite, "")
    return (f"selection is on again for suite {suite} (it was off: {was})\n" if was
            else f"selection was already on for suite {suite}\n")
