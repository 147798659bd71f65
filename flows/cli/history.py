"""``kiln history``: the benchmark history the nightlies stored, by commit, as a table and a plot.

No flow run: it only reads the artifact store (with the bench step's credentials on S3). Entries are read as
a run starting now would read them: one dated later, or that its run record does not back, is left out and
named below the table (:mod:`kiln.tasks.bench.trust`).
"""

from __future__ import annotations

import time
from pathlib import Path

from kiln.core.errors import InvalidInputError
from kiln.flows.run.common import store_session
from kiln.tasks.bench import history as benchhistory
from kiln.tasks.bench import series
from kiln.tasks.bench.plots import plot_trend
from kiln.tasks.bench.trust import HistoryReader
from kiln.tasks.project.config import KilnConfig


def show_history(config: KilnConfig, *, kernel: str | None, case: str | None, variant: str | None,
                 metric: str | None, limit: int, plot: Path | None) -> str:
    """The table of the stored history (oldest first); with ``plot``, the trend written there too.

    ``variant``/``metric`` default to the newest stored run's. Raises :class:`InvalidInputError` when the
    store holds no history, or none of the kernel, case, variant or metric named.
    """
    if limit < 1:
        raise InvalidInputError(f"--limit {limit}: show at least one run")
    store = benchhistory.open_history(config, session_factory=lambda: store_session(config, "bench"))
    if store is None:
        raise InvalidInputError(f"the artifact store {config.artifacts.url} could not be opened (see the log)")
    reader = HistoryReader(store, time.time())
    newest = benchhistory.newest_stored(reader, config)
    if newest is None:
        raise InvalidInputError(f"no benchmark history under {store.url}/{config.bench.history} yet: "
                                "every nightly stores its results there")
    variant, metric = variant or newest.variant, metric or newest.decision_metric
    runs = benchhistory.load_history(reader, config, variant=variant, metric=metric, limit=limit)
    if not runs:
        raise InvalidInputError(f"no stored benchmark of variant {variant!r} measured on {metric!r}")
    points = series.series(runs, kernel=kernel, case=case, policy=config.bench.regression,
                           threshold=config.bench.threshold)
    text = f"{len(runs)} runs of variant {variant} ({metric}), oldest first\n" + series.render(points)
    text += "".join(f"{line}\n" for line in reader.ignored)
    if plot is not None and len(runs) < 2:
        text += "plot: not drawn, a trend needs at least two runs\n"
    elif plot is not None:
        text += f"plot: {plot_trend(series.only(runs, kernel, case), plot)}\n"
    return text
