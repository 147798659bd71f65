"""kiln.toml's upload targets ([publish.targets.<name>] with a kind) as the release library's requests.

Plain functions (no Prefect): :mod:`kiln.flows.pypi` wraps them in task runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.core import identity
from kiln.core.errors import ConfigError
from kiln.core.manifest import RunManifest
from kiln.release.upload import trusted_publishing
from kiln.release.upload.kinds import UploadTargetConfig
from kiln.release.upload.pypi_plan import GIB, MIB, Limits
from kiln.release.upload.pypi_release import UploadRequest
from kiln.release.upload.twine import Endpoint, IndexCredentials
from kiln.release.upload.uploaders import PyPITargetConfig, Uploader, oidc_base, uploader_for
from kiln.tasks.build.plan import kiln_state
from kiln.tasks.build.sdist import build_sdist
from kiln.tasks.project.config import KilnConfig


def upload_target(config: KilnConfig, name: str) -> UploadTargetConfig:
    targets = config.publish.upload_targets
    if name not in targets:
        raise ConfigError(f"unknown upload target {name!r}; kiln.toml defines {sorted(targets) or 'none'}"
                          " ([publish.targets.<name>] with a kind, e.g. kind = \"upload\")")
    return targets[name]


def uploader(config: KilnConfig, name: str) -> Uploader:
    """The implementation of target ``name``'s kind (:data:`kiln.release.upload.uploaders.UPLOADERS`)."""
    return uploader_for(upload_target(config, name).kind)


def endpoint(config: KilnConfig, name: str) -> Endpoint:
    target = upload_target(config, name)
    return Endpoint(name, target.url, target.index_url, target.timeout_s)


def upload_request(config: KilnConfig, manifest: RunManifest, name: str, version: str) -> UploadRequest:
    """The PyPI variant's wheels of the run and, for a target with ``sdist = true``, the run's sdist (each checked
    against the sha256 the run recorded) for ``name``."""
    target = upload_target(config, name)
    wheels = tuple(manifest.verify(a) for a in manifest.artifacts_of("wheel", target.pypi_variant)
                   if a.state == "ok")
    sdists = tuple(manifest.verify(a) for a in manifest.artifacts_of("sdist") if a.state == "ok") if target.sdist \
        else ()
    limits = Limits(target.size_limit_mib * MIB, int(target.quota_gib * GIB))
    return UploadRequest(endpoint(config, name), config.project.distribution, version, target.pypi_variant,
                         wheels, sdists, limits)


def sdist_wanted(config: KilnConfig, manifest: RunManifest) -> str:
    """Why the release needs an sdist built now (an upload target ships one and the run has none), or ""."""
    wanting = sorted(name for name, target in config.publish.upload_targets.items() if target.sdist)
    if not wanting or manifest.artifacts_of("sdist"):
        return ""
    return f"publish.targets.{wanting[0]}.sdist = true"


def build_release_sdist(config: KilnConfig, version: str, out_dir: Path) -> Path:
    """The project's sdist at the public version of ``version``, built in ``out_dir`` (kiln.tasks.build.sdist)."""
    return build_sdist(config.path(config.build.project_dir), config.project.distribution, version, out_dir,
                       config.build.backend_timeout_s, kiln_state(config))


def _token_targets(config: KilnConfig) -> list[tuple[str, PyPITargetConfig]]:
    """The targets whose credentials come from a token block or the worker's identity (the ``upload`` kind's
    keys); a kind whose uploader finds its credentials otherwise has nothing to check before the build."""
    return [(name, target) for name, target in sorted(config.publish.upload_targets.items())
            if isinstance(target, PyPITargetConfig)]


def missing_tokens(config: KilnConfig) -> list[str]:
    """One line per upload target with neither a Secret block for its API token nor Trusted Publishing (a
    real release refuses)."""
    return [f"publish.targets.{name}: no token_block names the Prefect Secret block holding its API token;"
            f" a release cannot upload there (create the block, then set token_block = \"<block name>\"; or set"
            f" trusted_publishing = true where the worker has an OIDC identity)"
            for name, target in _token_targets(config)
            if target.token_block is None and not target.trusted_publishing]


def check_identities(config: KilnConfig) -> None:
    """NoIdentityError (naming the target and the identities that work) when a Trusted Publishing target's
    worker has no OIDC identity; the identity token detected here is dropped (the upload mints its own)."""
    for name, target in _token_targets(config):
        if target.trusted_publishing:
            try:
                with identity.exposed():
                    trusted_publishing.check_identity(oidc_base(target))
            except trusted_publishing.NoIdentityError as exc:
                raise trusted_publishing.NoIdentityError(f"publish.targets.{name}.trusted_publishing: {exc}") from exc


def credentials(config: KilnConfig, name: str, secret: Callable[[str], str]) -> IndexCredentials:
    """Target ``name``'s credentials, as its kind's uploader reads (``secret``: a Secret block by name) or mints
    them. Called inside the upload task only: they are held for that upload."""
    return uploader(config, name).credentials(upload_target(config, name), name, secret)
