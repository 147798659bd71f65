"""What every stage of one run is handed: one typed parameter, not a dict.

The nightly and the release open the run, then each stage — the build, the
tests, the benchmarks, publishing; in this process or dispatched to a work
pool — continues that run with the same facts: the project's ``kiln.toml``,
the local view (``out``), the run's id and the commit the run names.
``RunParams`` carries them, frozen and JSON-serialisable (a pydantic model, so
a flow that takes it as a parameter gets a form in the Prefect UI). The
caller's config is already loaded: ``config_path`` is the file it was read
from, for a stage flow that loads it in its own process (a dispatched one).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kiln.core.record import RunRecord
from kiln.tasks.project.config import KilnConfig


class RunParams(BaseModel):
    """The inputs every stage flow of one run shares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config_path: str = "kiln.toml"
    out: str = "out"
    run_id: str | None = None
    commit: str = ""  # the commit a dispatched stage's worker must be at ("": a dirty tree, not dispatched)

    @classmethod
    def of(cls, config: KilnConfig, run: RunRecord, out: str) -> RunParams:
        """The parameters of ``run``'s stages: its config's file, ``out``, its id, and its commit when clean."""
        source = run.header.source
        return cls(config_path=str(config.config_file), out=out, run_id=run.run_id,
                   commit=source.commit if source.clean else "")


class SuiteOptions(BaseModel):
    """How the test flow's suites run and report, over what kiln.toml says (``kiln test``'s options).

    ``isolate``, ``timeout`` (seconds per test) and ``retries`` (of infrastructure failures) override every
    suite's own; ``pytest_args`` go to every suite; ``junit`` and ``json_path`` also write the combined
    reports there. ``isolate`` is checked by the flow (a clear error before anything is written).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    isolate: str = "test"
    timeout: float | None = None
    retries: int = 1
    pytest_args: list[str] | None = None
    junit: str | None = None
    json_path: str | None = None
    full: bool = False  # run every test: none is carried from an earlier run (kiln.tasks.testing.selection)
