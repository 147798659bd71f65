"""The ``[permissions.<step>]`` sections of ``kiln.toml``: what each step may touch, and whose credentials it uses.

Credentials are explicit: a step that talks to an ``s3://`` location (the
artifact store for every step; any publish target for a publishing step)
must name where its credentials come from — a Prefect ``AwsCredentials``
block, a role to assume, or ``ambient = true`` for the worker's own. Leaving
it out is a configuration error at load, never a silent fall-back to whatever
credentials the worker happens to hold. A step that touches only ``file://``
locations uses no credentials, so it needs no choice. Kept apart from
:mod:`kiln.tasks.project.config` so each module has one subject; the models are part
of :class:`kiln.tasks.project.config.KilnConfig`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from kiln.core.steps import CHANNEL_OF_STEP, STEPS, Step
from kiln.core.store import is_remote
from kiln.tasks.project.config_fields import BlockName, Prefix, RoleArn

_CHOICES = ('credentials = { block = "<AwsCredentials block>" }, '
            'credentials = { role_arn = "arn:aws:iam::<account>:role/<name>" }, '
            "or credentials = { ambient = true } to use the worker's own")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Credentials(_Model):
    """Where a step's store credentials come from; exactly one source."""

    block: BlockName | None = None  # a Prefect AwsCredentials block holding the step's keys
    role_arn: RoleArn | None = None  # an IAM role the step assumes (its policy: kiln policies)
    ambient: bool = False  # the worker's own AWS identity (instance profile, IRSA, environment)

    @model_validator(mode="after")
    def _one_source(self) -> Credentials:
        chosen = [n for n, v in (("block", self.block), ("role_arn", self.role_arn), ("ambient", self.ambient)) if v]
        if len(chosen) != 1:
            raise ValueError(f"give exactly one of block, role_arn, ambient = true (got {chosen or 'none'})")
        return self


class Permission(_Model):
    read: tuple[Prefix, ...] = ()  # store prefixes the step's generated policy lets it read
    write: tuple[Prefix, ...] = ()  # store prefixes the step's generated policy lets it write
    # None: not chosen. Allowed only for a step that touches no s3:// location (see unchosen_credentials).
    credentials: Credentials | None = None


def s3_locations(step: Step, artifacts_url: str, publish_urls: Iterable[str]) -> list[str]:
    """The ``s3://`` locations ``step`` talks to: the artifact store (every step keeps its run record
    there), and for a publishing step every publish target (``--to`` may pick any of them)."""
    urls = [artifacts_url, *(publish_urls if step in CHANNEL_OF_STEP else ())]
    return [url for url in urls if is_remote(url)]


def unchosen_credentials(permissions: Mapping[Step, Permission], artifacts_url: str,
                         publish_urls: Iterable[str]) -> list[str]:
    """One message per step that talks to S3 but names no credentials source; empty when all is explicit."""
    urls = list(publish_urls)
    problems = []
    for step in STEPS:
        permission = permissions.get(step)
        if permission is None or permission.credentials is not None:
            continue
        locations = s3_locations(step, artifacts_url, urls)
        if locations:
            problems.append(f"permissions.{step}: no credentials chosen, and step {step!r} talks to "
                            f"{', '.join(locations)}; Kiln never falls back to the worker's credentials "
                            f"unasked: under [permissions.{step}] write {_CHOICES}")
    return problems
