"""The ``[pools]`` section of ``kiln.toml``: which Prefect work pool runs each kind of unit.

A unit goes to ``<flow>/<pool>`` (``build/kiln-build``, ``test/kiln-process``,
``publish/kiln-process``; a GPU suite's own ``pool``) when the Prefect server
has that deployment, and runs in the calling flow's process otherwise (the
embedded default, a laptop). Kept apart from :mod:`kiln.tasks.project.config` so each
module has one subject; the model is part of :class:`kiln.tasks.project.config.KilnConfig`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PoolName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]


class Pools(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    build: PoolName = "kiln-build"     # each variant's build
    cpu: PoolName = "kiln-process"     # CPU test suites and publishing
    # A dispatched build or publish not finished by then fails, naming its pool (a suite has its own deadline_s).
    deadline_s: float = Field(default=3600, gt=0)
    # How often a unit whose worker was lost (its flow run Crashed) is dispatched again.
    retries: int = Field(default=0, ge=0, le=3)
