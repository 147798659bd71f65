"""Least-privilege IAM policy documents, one per pipeline step, from kiln.toml.

Pure: plain inputs in, ``{step: policy_document}`` out, deterministic JSON.
Every prefix in ``[permissions.*]`` and ``[publish] channels`` is relative to
the S3 publish target's base prefix (``s3://bucket/base`` → ``base/<prefix>``),
the same place the store writes a channel.

Besides the allows, each document carries explicit ``Deny`` statements: an
explicit deny wins over any allow another policy attached to the same
principal might grant, so a step stays inside its box even when an operator
attaches something broader by mistake.

The release baseline (``<bench.history>/published/``: the benchmark results a
release is judged against) is written only by the release publisher, after a
verified release: its document allows that prefix, and every other step's
denies it — the bench step writes the rest of the history, never a baseline.
Likewise the build ledger (``build-ledger/`` under each prefix the build step
writes: the sha256 of every wheel it built, which is all ``kiln bisect``
trusts) is denied to every step but the build, and so is the unit cache's shared tier
(``[build.cache] prefix`` under each prefix the build step writes, when ``remote = "artifacts"``), and with it
the compile cache's shared tier below it (``<prefix>/compile/``, kiln.tasks.build.compile_tier): every worker's
build serves what is there, so only the build role may put anything there; the other steps read it (through
their own read prefixes) or nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import ConfigError
from kiln.core.steps import (
    BASELINE_STEP,
    BUILD_LEDGER,
    CHANNEL_OF_STEP,
    DELETING_STEPS,
    LEDGER_STEP,
    STEPS,
    prefix_problem,
)
from kiln.core.store import is_remote

DELETE_ACTIONS = ("s3:DeleteObject",)

READ_ACTIONS = ("s3:GetObject",)  # HeadObject is authorised as GetObject
WRITE_ACTIONS = ("s3:AbortMultipartUpload", "s3:PutObject")
# Deletes and anything that changes a bucket's or an object's settings. Kept
# to wildcards so the document stays under STS's 2048-character session
# policy limit.
DESTRUCTIVE_ACTIONS = (
    "s3:BypassGovernanceRetention",
    "s3:Delete*",
    "s3:PutBucket*",
    "s3:PutEncryptionConfiguration",
    "s3:PutLifecycleConfiguration",
    "s3:PutObjectAcl",
    "s3:PutObjectLegalHold",
    "s3:PutObjectRetention",
    "s3:PutObjectVersionAcl",
    "s3:PutReplicationConfiguration",
)
SESSION_POLICY_LIMIT = 2048


@dataclass(frozen=True)
class StepAccess:
    """What one step may read and write, as prefixes relative to the base."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()


def _prefix(value: str, where: str) -> str:
    """Normalise a prefix to ``a/b/`` form; refuse what IAM would misread."""
    problem = prefix_problem(value)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    joined = "/".join(p for p in value.strip("/").split("/") if p)
    return f"{joined}/" if joined else ""


def _overlaps(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def _validate(steps: Mapping[str, StepAccess], channels: Mapping[str, str], baselines: str | None) -> None:
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ConfigError(f"[permissions] names unknown steps {unknown}; known steps: {list(STEPS)}")
    for channel, prefix in channels.items():
        if baselines is not None and _overlaps(baselines, prefix):
            raise ConfigError(f"the release baseline prefix {baselines!r} overlaps the {channel} index prefix "
                              f"{prefix!r}; keep [bench] history outside every channel")
    for name in CHANNEL_OF_STEP.values():
        if name not in channels:
            raise ConfigError(f"[publish] channels has no {name!r} prefix; policies need one per channel")
    for step, access in steps.items():
        own = CHANNEL_OF_STEP.get(step)
        for write in access.write:
            if own is not None and not write.startswith(channels[own]):
                raise ConfigError(f"permissions.{step}.write: {write!r} is outside the {own} channel prefix "
                                  f"{channels[own]!r}; {step} may write only there")
            for channel, prefix in channels.items():
                if channel != own and _overlaps(write, prefix):
                    raise ConfigError(f"permissions.{step}.write: {write!r} overlaps the {channel} index prefix "
                                      f"{prefix!r}; only publish-{channel} may write an index")


def _object_arns(bucket: str, base: str, prefixes: Sequence[str]) -> list[str]:
    return sorted({f"arn:aws:s3:::{bucket}/{base}{p}*" for p in prefixes})


def _statement(sid: str, effect: str, actions: Sequence[str], resources: Sequence[str],
               condition: dict[str, Any] | None = None) -> dict[str, Any]:
    statement: dict[str, Any] = {"Sid": sid, "Effect": effect, "Action": sorted(actions), "Resource": list(resources)}
    if condition:
        statement["Condition"] = condition
    return statement


def _baseline_statement(step: str, bucket: str, base: str, baselines: str) -> dict[str, Any]:
    """The release publisher writes the release baseline; every other step is denied it."""
    resources = _object_arns(bucket, base, (baselines,))
    if step == BASELINE_STEP:
        return _statement("WriteReleaseBaseline", "Allow", (*READ_ACTIONS, *WRITE_ACTIONS), resources)
    return _statement("DenyReleaseBaselineWrites", "Deny", ("s3:PutObject*",), resources)


def _step_policy(step: str, access: StepAccess, bucket: str, base: str, channels: Mapping[str, str],
                 baselines: str | None = None, ledgers: Sequence[str] = (),
                 caches: Sequence[str] = ()) -> dict[str, Any]:
    statements = []
    if access.read:
        statements.append(_statement("Read", "Allow", READ_ACTIONS, _object_arns(bucket, base, access.read)))
        # Listing is a bucket-level action: scope it with the prefix condition.
        listed = sorted({f"{base}{p}*" for p in access.read})
        statements.append(_statement("List", "Allow", ("s3:ListBucket",), [f"arn:aws:s3:::{bucket}"],
                                     {"StringLike": {"s3:prefix": listed}}))
    deletes = step in DELETING_STEPS
    if access.write:
        actions = (*WRITE_ACTIONS, *DELETE_ACTIONS) if deletes else WRITE_ACTIONS
        statements.append(_statement("Write", "Allow", actions, _object_arns(bucket, base, access.write)))
    foreign = [p for c, p in sorted(channels.items()) if c != CHANNEL_OF_STEP.get(step)]
    if foreign:
        denied = ("s3:Delete*", "s3:PutObject*") if deletes else ("s3:PutObject*",)
        statements.append(_statement("DenyForeignIndexWrites", "Deny", denied, _object_arns(bucket, base, foreign)))
    if baselines is not None:
        statements.append(_baseline_statement(step, bucket, base, baselines))
    if ledgers and step != LEDGER_STEP:
        statements.append(_statement("DenyBuildLedgerWrites", "Deny", ("s3:PutObject*",),
                                     _object_arns(bucket, base, ledgers)))
    if caches and step != LEDGER_STEP:
        statements.append(_statement("DenyBuildCacheWrites", "Deny", ("s3:PutObject*",),
                                     _object_arns(bucket, base, caches)))
    destructive = [a for a in DESTRUCTIVE_ACTIONS if a != "s3:Delete*"] + ["s3:DeleteBucket*"] if deletes \
        else DESTRUCTIVE_ACTIONS
    statements.append(_statement("DenyDestructive", "Deny", destructive,
                                 [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]))
    return {"Version": "2012-10-17", "Statement": statements}


def policies_for(bucket: str, base_prefix: str, steps: Mapping[str, StepAccess],
                 channels: Mapping[str, str], baselines: str | None = None,
                 build_cache: str | None = None) -> dict[str, dict[str, Any]]:
    """``{step: IAM policy document}`` for every step in ``steps``; with ``baselines`` (the release baseline
    prefix), only ``publish-release`` may write it; only ``build`` may write its build ledger, and with
    ``build_cache`` (the unit cache's prefix in the artifact store) that shared tier.

    Raises :class:`ConfigError` (and returns nothing) when a step's declared
    access would break the least-privilege rules: build, test and bench write
    no index; each publisher writes only its own channel.
    """
    if not bucket or "/" in bucket or "*" in bucket:
        raise ConfigError(f"bucket {bucket!r} is not a bucket name")
    base = _prefix(base_prefix, "publish target prefix")
    norm_channels = {c: _prefix(p, f"publish.channels.{c}") for c, p in channels.items()}
    norm_steps = {
        step: StepAccess(
            read=tuple(_prefix(p, f"permissions.{step}.read") for p in access.read),
            write=tuple(_prefix(p, f"permissions.{step}.write") for p in access.write),
        )
        for step, access in steps.items()
    }
    norm_baselines = None if baselines is None else _prefix(baselines, "bench.history (the release baseline)")
    _validate(norm_steps, norm_channels, norm_baselines)
    build = norm_steps.get(LEDGER_STEP, StepAccess())
    ledgers = tuple(f"{prefix}{BUILD_LEDGER}" for prefix in build.write)
    cache = None if build_cache is None else _prefix(build_cache, "build.cache.prefix")
    caches = tuple(f"{prefix}{cache}" for prefix in build.write) if cache else ()
    return {step: _step_policy(step, norm_steps[step], bucket, base, norm_channels, norm_baselines, ledgers,
                               caches)
            for step in sorted(norm_steps)}


# Any: the KilnConfig (kiln.tasks.project), which release/ may not import
def s3_target(config: Any, target: str | None = None) -> tuple[str, str]:
    """``(bucket, base_prefix)`` of the S3 publish target the policies cover.

    ``config`` is duck-typed (a ``KilnConfig``): ``release`` does not import
    ``tasks``. Without ``target``, the default target if it is S3, else the
    only S3 target.
    """
    targets = config.publish.targets
    if target is None:
        s3 = sorted(n for n, t in targets.items() if is_remote(t.url))
        if is_remote(targets[config.publish.default_target].url):
            target = config.publish.default_target
        elif len(s3) == 1:
            target = s3[0]
        elif not s3:
            raise ConfigError("kiln.toml has no s3:// publish target; IAM policies apply to S3 targets only")
        else:
            raise ConfigError(f"cannot tell which S3 target the policies are for (S3 targets: {s3}); name one")
    if target not in targets:
        raise ConfigError(f"unknown publish target {target!r}; kiln.toml defines {sorted(targets)}")
    url = targets[target].url
    if not is_remote(url):
        raise ConfigError(f"publish target {target!r} is {url!r}; IAM policies apply to s3:// targets only")
    bucket, _, base = url[len("s3://"):].partition("/")
    return bucket, base


# Any: the KilnConfig (kiln.tasks.project), which release/ may not import
def policies_from_config(config: Any, target: str | None = None) -> dict[str, dict[str, Any]]:
    """Policies for every step ``config.permissions`` declares; the release baseline is
    ``<[bench] history>/published/`` (kiln.tasks.bench.history), relative to the base like every prefix."""
    bucket, base = s3_target(config, target)
    steps = {step: StepAccess(tuple(p.read), tuple(p.write)) for step, p in config.permissions.items()}
    baselines = f"{config.bench.history.strip('/')}/published/"
    shared = config.build.cache
    build_cache = shared.prefix if shared.remote == "artifacts" else None
    return policies_for(bucket, base, steps, dict(config.publish.channels), baselines, build_cache)


def read_only(document: Mapping[str, Any], bucket: str) -> dict[str, Any]:
    """``document`` narrowed to its reads (a session that must change nothing: ``kiln bisect``): its
    ``Read`` and ``List`` allows and every deny, plus an explicit deny of every write in ``bucket``."""
    kept = [s for s in document["Statement"] if s["Effect"] == "Deny" or s.get("Sid") in ("Read", "List")]
    writes = ("s3:AbortMultipartUpload", "s3:Delete*", "s3:PutObject*")
    kept.append(_statement("DenyEveryWrite", "Deny", writes, [f"arn:aws:s3:::{bucket}/*"]))
    return {"Version": document["Version"], "Statement": kept}


def render(document: Mapping[str, Any]) -> str:
    """Stable, reviewable JSON (sorted keys, two-space indent, final newline)."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def session_policy(document: Mapping[str, Any]) -> str:
    """Compact JSON for STS ``AssumeRole(Policy=...)``; refuses one STS would reject."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    if len(text) > SESSION_POLICY_LIMIT:
        raise ConfigError(f"the session policy is {len(text)} characters; STS accepts at most "
                          f"{SESSION_POLICY_LIMIT}: declare fewer read/write prefixes for this step")
    return text
