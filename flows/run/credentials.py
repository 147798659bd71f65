"""Per-step store credentials: each step gets its own boto3 session.

Sources, exactly one per step (``[permissions.<step>.credentials]``):

* ``block = "name"`` — a Prefect ``AwsCredentials`` block (prefect-aws);
* ``role_arn = "arn:..."`` — STS ``AssumeRole`` with the step's generated
  least-privilege policy as the session policy, so the session can never do
  more than ``kiln policies`` says even if the role itself is broader;
* ``ambient = true`` — the worker's own credentials, only when kiln.toml says
  so explicitly; a step that names no source is refused when kiln.toml is
  loaded (:mod:`kiln.tasks.project.config_permissions`), never given the worker's.

Secrets are never logged: only the block name, the role ARN and the step.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from kiln.core.errors import AccessDeniedError, ConfigError, TransientStoreError
from kiln.core.store import is_remote
from kiln.release.stores.policies import policies_from_config, s3_target, session_policy
from kiln.release.stores.policies import read_only as read_only_policy
from kiln.tasks.project.config import KilnConfig
from kiln.tasks.project.config_permissions import Permission

log = logging.getLogger(__name__)

SESSION_SECONDS = 3600


def _target_settings(config: KilnConfig) -> tuple[str | None, str | None]:
    """Region and endpoint of the S3 publish target (None, None without one)."""
    targets = config.publish.targets
    default = targets.get(config.publish.default_target)
    s3 = [t for _, t in sorted(targets.items()) if is_remote(t.url)]
    chosen = default if default is not None and is_remote(default.url) else (s3[0] if s3 else None)
    return (chosen.region, chosen.endpoint) if chosen else (None, None)


def _from_block(name: str, step: str) -> boto3.Session:
    from prefect_aws import AwsCredentials  # prefect-aws is only needed when a block is used

    try:
        block = cast(AwsCredentials, AwsCredentials.load(name))  # sync code: the block itself, never a coroutine
    except ValueError as exc:
        raise ConfigError(f"permissions.{step}.credentials.block: no AwsCredentials block named {name!r} "
                          f"(create it in the Prefect UI or with AwsCredentials(...).save({name!r}))") from exc
    has_secret = block.aws_secret_access_key is not None and bool(block.aws_secret_access_key.get_secret_value())
    if not ((block.aws_access_key_id and has_secret) or block.profile_name or block.assume_role_arn):
        # An empty block silently falls back to the worker's ambient chain.
        raise ConfigError(f"AwsCredentials block {name!r} (step {step}) holds no keys, profile or role; "
                          f"it would use the worker's ambient credentials — set ambient = true to mean that")
    session = block.get_boto3_session()
    log.info("step %s: credentials from AwsCredentials block %r", step, name)
    return session


def _session_document(config: KilnConfig, step: str, read_only: bool) -> str:
    """The step's generated policy as an STS session policy; ``read_only``: its reads alone."""
    document = policies_from_config(config)[step]
    return session_policy(read_only_policy(document, s3_target(config)[0]) if read_only else document)


def _assume_role(config: KilnConfig, step: str, role_arn: str, region: str | None, endpoint: str | None,
    # Any: a boto3 STS client, or a test's stand-in (boto3's clients carry no types)
                 sts_client: Any = None, read_only: bool = False) -> boto3.Session:
    policy = _session_document(config, step, read_only)
    # MinIO and moto serve STS on the store's endpoint; AWS ignores endpoint=None. A fresh session, not boto3's
    # default one: that caches the first credentials it resolved, and a daemon serves commands whose environments
    # (the worker's base keys) differ.
    sts = sts_client or boto3.Session(region_name=region).client("sts", endpoint_url=endpoint)
    log.info("step %s: assuming role %s with its generated session policy", step, role_arn)
    try:
        answer = sts.assume_role(RoleArn=role_arn, RoleSessionName=f"kiln-{step}", Policy=policy,
                                 DurationSeconds=SESSION_SECONDS)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("Throttling", "RequestLimitExceeded", "ServiceUnavailable"):
            raise TransientStoreError(f"STS throttled AssumeRole of {role_arn} for step {step}") from exc
        if code in ("NoSuchEntity", "ValidationError", "MalformedPolicyDocument", "PackedPolicyTooLarge"):
            raise ConfigError(f"permissions.{step}.credentials.role_arn {role_arn!r}: {code}: "
                              f"{exc.response['Error'].get('Message', '')}") from exc
        raise AccessDeniedError(f"step {step} may not assume role {role_arn} ({code}); check the role's trust "
                                f"policy and the worker's sts:AssumeRole permission") from exc
    except BotoCoreError as exc:
        raise ConfigError(f"cannot assume role {role_arn} for step {step}: {type(exc).__name__} "
                          f"(the worker needs base credentials to call STS)") from exc
    creds = answer["Credentials"]
    return boto3.Session(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                         aws_session_token=creds["SessionToken"], region_name=region)


# sts_client: as in _assume_role (Any: boto3's clients carry no types).
def session_for(config: KilnConfig, step: str, *, sts_client: Any = None, read_only: bool = False) -> boto3.Session:
    """The boto3 session ``step`` talks to the store with; ``read_only``: narrowed to its reads where the
    credentials allow it (an assumed role's session policy), else said in the log.

    Raises :class:`ConfigError` when the step has no ``[permissions]`` entry or
    names no credentials source, the block does not exist or is empty, or the
    role cannot be found. The worker's own credentials are used only with
    ``ambient = true``.
    """
    by_name: dict[str, Permission] = {str(k): v for k, v in config.permissions.items()}  # any name may be asked
    permission = by_name.get(step)
    if permission is None:
        raise ConfigError(f"kiln.toml has no [permissions.{step}]; every step that touches the store needs "
                          f"one (known: {sorted(config.permissions)})")
    source = permission.credentials
    if source is None:
        # Load refuses this for a step that talks to S3; a step that reaches here anyway gets no fall-back.
        raise ConfigError(f"[permissions.{step}] names no credentials, so step {step} may not talk to S3; "
                          f"write credentials = {{ block = ... }}, {{ role_arn = ... }} or {{ ambient = true }} there")
    region, endpoint = _target_settings(config)
    if read_only and not source.role_arn:
        log.warning("step %s's credentials cannot be narrowed to reads (only an assumed role's can): the "
                    "read-only store still refuses every write", step)
    if source.block:
        return _from_block(source.block, step)
    if source.role_arn:
        return _assume_role(config, step, source.role_arn, region, endpoint, sts_client, read_only)
    # Credentials holds exactly one source: what is left is ambient = true, written in kiln.toml.
    log.warning("step %s uses the worker's ambient credentials, as [permissions.%s] credentials = "
                "{ ambient = true } says", step, step)
    return boto3.Session(region_name=region)
