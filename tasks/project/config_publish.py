"""``[publish]`` and ``[artifacts]`` of kiln.toml: where indexes go (file:// and s3:// stores), the upload targets
of other indexes, the channels and what retention keeps.

Part of :class:`kiln.tasks.project.config.KilnConfig`, validated with it at load.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, model_validator

from kiln.core.store import is_remote, scheme_of
from kiln.release.upload.kinds import UPLOAD_KINDS, UploadTargetConfig, load
from kiln.tasks.project.config_fields import (
    BlockName,
    Endpoint,
    IndexUrl,
    ProjectPath,
    Region,
    StorePrefix,
    check_store_url,
)

Channel = Literal["nightly", "release"]
CHANNELS: tuple[Channel, ...] = get_args(Channel)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Target(_Model):
    url: Annotated[str, AfterValidator(check_store_url)]  # where the indexes go: file://path, or s3://bucket/prefix
    region: Region | None = None  # the S3 bucket's region (default: the AWS configuration's)
    endpoint: Endpoint | None = None  # an S3-compatible endpoint URL instead of AWS's
    # The 12-digit AWS account that must own the bucket (S3's expected-bucket-owner check).
    expected_owner: str | None = Field(default=None, pattern=r"^[0-9]{12}$")
    # Whether the S3 server checks the ChecksumSHA256 it is sent (then a write needs no
    # read-back). Unset: true on AWS, false with a custom endpoint (moto does not check).
    verifies_checksums: bool | None = None
    # A file:// store is owner-only (its root 0700), and a root another user owns or may write into is
    # refused; public = true keeps it readable by every local user and accepts such a root, for an index
    # another user's web server serves.
    public: bool = False
    # The CDN or web server in front of this store (its root), where users download: after a publish, every new
    # file and changed page is downloaded through it and must have the index's sha256 (kiln.release.read.public).
    public_url: IndexUrl | None = None

    @property
    def kind(self) -> str:
        """The store backend's scheme (``file``, ``s3``: a key of kiln.core.store.BACKENDS)."""
        return scheme_of(self.url)

    @model_validator(mode="after")
    def _s3_only(self) -> Target:
        if self.verifies_checksums is not None and self.kind != "s3":
            raise ValueError(f"verifies_checksums applies to s3:// targets only, not {self.url!r}")
        if self.public and is_remote(self.url):
            raise ValueError(f"public applies to file:// targets only (a bucket policy decides), not {self.url!r}")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError(f"public_url {self.public_url!r} must be the http(s):// URL users download from (a CDN"
                             " or web server in front of the store)")
        return self


class UploadTarget(_Model):
    """``[publish.targets.<name>]`` with ``kind = "upload"``: a PyPI-compatible index (kiln.release.upload.twine).

    Only the release flow uploads there, after Kiln's own indexes: the ``pypi_variant``'s wheel under the
    release's public version, judged first by PyPI's rules (kiln.release.upload.pypi_plan)."""

    kind: Literal["upload"]  # the kind (kiln.release.upload.kinds) whose model this is: a PyPI-compatible upload API
    url: IndexUrl  # the legacy upload API, e.g. https://upload.pypi.org/legacy/
    index_url: IndexUrl  # its simple API, read for what the project already holds, e.g. https://pypi.org/simple/
    pypi_variant: str  # the one variant that goes there (PyPI refuses local versions such as +cu130)
    size_limit_mib: int = Field(default=100, ge=1, le=1024)  # PyPI's default; a grant is at most 1 GiB
    quota_gib: float = Field(default=10, gt=0)  # the project's total on the index
    token_block: BlockName | None = None  # the Prefect Secret block holding the API token
    # Instead of a token: the worker's OIDC identity (GitHub Actions, GitLab, Google Cloud) exchanged at the
    # index for a short-lived upload token inside the upload task (kiln.release.upload.trusted_publishing).
    trusted_publishing: bool = False
    oidc_url: IndexUrl | None = None  # where /_/oidc/audience and /_/oidc/mint-token are; default: url's host
    username: str = "__token__"  # the upload's user name; PyPI's API tokens go with __token__
    timeout_s: float = Field(default=1800, gt=0, le=7200)  # one file's upload
    # The project's sdist too, built at the release's public version and sent after the wheel (a pep517 project
    # only: a registry package's sources build nothing without Kiln's AOT step; see kiln.tasks.build.sdist).
    sdist: bool = False

    @model_validator(mode="after")
    def _one_credential(self) -> UploadTarget:
        if self.trusted_publishing and self.token_block is not None:
            raise ValueError("token_block and trusted_publishing = true both set: choose one (an API token from"
                             " a Secret block, or the worker's OIDC identity exchanged at the index)")
        return self


# Any: the raw TOML table, before the model validates it
def _split_upload_targets(data: Any) -> Any:
    """Tables of [publish.targets] with a ``kind`` become ``upload_targets``: every other reader of
    ``targets`` (stores, policies, credentials) keeps seeing file:// and s3:// targets only."""
    if not isinstance(data, dict) or not isinstance(data.get("targets"), dict):
        return data
    targets = data["targets"]
    uploads = {k: v for k, v in targets.items() if isinstance(v, dict) and "kind" in v}
    for name, table in uploads.items():
        _check_upload_kind(name, table["kind"])
    return {**data, "targets": {k: v for k, v in targets.items() if k not in uploads},
            "upload_targets": {**data.get("upload_targets", {}), **uploads}}


def _check_upload_kind(name: str, kind: object) -> None:
    """``kind`` is a key of the kinds table, read as names only: no uploader (nor twine, nor wheel) is imported,
    since every process that loads kiln.toml comes here, some inside a wheel's environment without them."""
    if isinstance(kind, str) and kind in UPLOAD_KINDS:
        return
    hint = difflib.get_close_matches(str(kind), list(UPLOAD_KINDS), n=1)
    raise ValueError(f"targets.{name}.kind: {kind!r} is not a target kind"
                     + (f" (did you mean {hint[0]!r}?)" if hint else "")
                     + f"; the kinds are {sorted(UPLOAD_KINDS)} (\"upload\": a PyPI-compatible index);"
                     " file:// and s3:// targets are told by their url")


def upload_target_model(kind: str) -> type[BaseModel]:
    """The model of ``kind``'s targets, named by its entry in the kinds table: imported, never its uploader."""
    spec = UPLOAD_KINDS[kind].config
    model = load(spec)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ValueError(f"upload kind {kind!r}: {spec!r} names no pydantic model of its targets")
    return model


def upload_target_models() -> dict[str, type[BaseModel]]:
    """Every kind's target model, by kind (the reference documents each)."""
    return {kind: upload_target_model(kind) for kind in UPLOAD_KINDS}


# Any: the raw TOML table, or a target a config validated again already holds
def _by_kind(table: Any) -> UploadTargetConfig:
    """``table`` validated by its kind's own model, so each kind refuses the keys it does not know; a table
    whose kind is unknown never gets here (:func:`_split_upload_targets` names it first)."""
    if isinstance(table, dict):
        kind = table.get("kind")
        if not isinstance(kind, str) or kind not in UPLOAD_KINDS:
            raise ValueError(f"kind {kind!r} is not a target kind; the kinds are {sorted(UPLOAD_KINDS)}")
        table = upload_target_model(kind).model_validate(table)
    if not isinstance(table, UploadTargetConfig):
        raise ValueError(f"not an upload target (a table with a kind of {sorted(UPLOAD_KINDS)}): {table!r}")
    return table


class PublishRetention(_Model):
    """``[publish.retention]``: what ``kiln prune`` keeps of a nightly channel (kiln.release.publish.prune)."""

    keep: int = Field(default=60, ge=1)  # newest versions kept per project and variant index
    grace_days: float = Field(default=7, ge=0)  # yanked this long before removal


class Publish(_Model):
    default_target: str = "local"  # the target a nightly publishes to when none is named
    # Each channel's folder name in a target (nightly, release).
    channels: dict[Channel, StorePrefix] = {"nightly": "nightly", "release": "release"}
    targets: dict[str, Target] = {}  # the publish targets by name: file:// or s3:// stores, or kind = "upload" indexes
    # Where the project's dependencies come from when installing from a Kiln index (which holds only the
    # project's own wheels): named in the install hint of every run and used by `kiln verify` on request.
    extra_index_urls: tuple[IndexUrl, ...] = ("https://pypi.org/simple",)
    # Pinned third-party wheels re-published in every index (see kiln.release.index.pins), relative to kiln.toml.
    pins: ProjectPath | None = None
    # A variant no suite ran on is published marked "PUBLISHED UNTESTED"; false holds it back instead,
    # and also every variant whose suite could not run here, whatever that suite's publish_untested says.
    publish_untested: bool = True
    # Before anything is uploaded, each variant's wheel must resolve with its dependencies (pip's resolver) from
    # the index as staged plus extra_index_urls. "refuse": a variant that does not is held back, naming the
    # requirement or the conflict; "warn": it is published, and the summary's first lines say it will not
    # install; "off": no check.
    check_dependencies: Literal["refuse", "warn", "off"] = "refuse"
    retention: PublishRetention = PublishRetention()  # what kiln prune keeps of a nightly channel
    # [publish.targets.<name>] tables with a kind (another index's upload API; "upload": PyPI-compatible), split
    # out at load and each validated by its kind's own model.
    upload_targets: dict[str, Annotated[UploadTargetConfig, PlainValidator(_by_kind)]] = {}

    @model_validator(mode="before")
    @classmethod
    # Any: the raw TOML table, before the model validates it
    def _uploads(cls, data: Any) -> Any:
        return _split_upload_targets(data)

    @model_validator(mode="after")
    def _default_exists(self) -> Publish:
        if self.default_target not in self.targets:
            raise ValueError(f"default_target {self.default_target!r} is not one of {sorted(self.targets)}")
        return self
