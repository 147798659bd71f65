"""``kiln quarantine``: the tests the flaky-test policy holds in quarantine, read from the artifact store.

No flow run: it only reads the list the test stage keeps (:mod:`kiln.tasks.testing.quarantine`), with the
test step's credentials on S3. An entry the run records it cites do not back is not listed as quarantined
but named below the list (:mod:`kiln.tasks.testing.provenance`): the test stage ignores it too.
"""

from __future__ import annotations

from kiln.flows.run.common import store_session
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.run.runs import artifact_store
from kiln.tasks.testing import quarantine
from kiln.tasks.testing.provenance import RunRecords, check_list


def show_quarantine(config: KilnConfig) -> str:
    store = artifact_store(config, store_session(config, "test", config.artifacts.kind))
    policy = config.testing.quarantine
    where = f"{store.url}/{quarantine.quarantine_key(policy)}"
    checked, ignored = check_list(RunRecords(store), quarantine.read_quarantine(store, policy))
    return quarantine.render(checked, where) + "".join(f"{line}\n" for line in ignored)
