"""kiln.toml's upload targets ([publish.targets.<name>] kind = "upload") as the release library's requests.

Plain functions (no Prefect): :mod:`kiln.flows.pypi` wraps them in task runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.core import identity
from kiln.core.errors import ConfigError
from kiln.core.manifest import RunManifest
from kiln.release import trusted_publishing
from kiln.release.pypi_plan import GIB, MIB, Limits
from kiln.release.pypi_release import UploadRequest
from kiln.release.upload import Endpoint, IndexCredentials
from kiln.release.uploaders import Uploader, uploader_for
from kiln.tasks.build.plan import kiln_state
from kiln.tasks.build.sdist import build_sdist
from kiln.tasks.project.config import KilnConfig, UploadTarget


def upload_target(config: KilnConfig, name: str) -> UploadTarget:
    targets = config.publish.upload_targets
    if name not in targets:
        raise ConfigError(f"unknown upload target {name!r}; kiln.toml defines {sorted(targets) or 'none'}"
                          " ([publish.targets.<name>] with kind = \"upload\")")
    return targets[name]


def uploader(config: KilnConfig, name: str) -> Uploader:
    """The implementation of target ``name``'s kind (:data:`kiln.release.uploaders.UPLOADERS`)."""
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


def missing_tokens(config: KilnConfig) -> list[str]:
    """One line per upload target with neither a Secret block for its API token nor Trusted Publishing (a
    real release refuses)."""
    return [f"publish.targets.{name}: no token_block names the Prefect Secret block holding its API token;"
            f" a release cannot upload there (create the block, then set token_block = \"<block name>\"; or set"
            f" trusted_publishing = true where the worker has an OIDC identity)"
            for name, target in sorted(config.publish.upload_targets.items())
            if target.token_block is None and not target.trusted_publishing]


def oidc_base(target: UploadTarget) -> str:
    return trusted_publishing.oidc_base(target.url, target.oidc_url)


def check_identities(config: KilnConfig) -> None:
    """NoIdentityError (naming the target and the identities that work) when a Trusted Publishing target's
    worker has no OIDC identity; the identity token detected here is dropped (the upload mints its own)."""
    for name, target in sorted(config.publish.upload_targets.items()):
        if target.trusted_publishing:
            try:
                with identity.exposed():
                    trusted_publishing.check_identity(oidc_base(target))
            except trusted_publishing.NoIdentityError as exc:
                raise trusted_publishing.NoIdentityError(f"publish.targets.{name}.trusted_publishing: {exc}") from exc


def credentials(target: UploadTarget, name: str, secret: Callable[[str], str]) -> IndexCredentials:
    """The upload's credentials: a token minted from the worker's identity, or the API token ``secret`` reads
    from the target's Secret block. Called inside the upload task only: the token is held for that upload."""
    if target.trusted_publishing:
        with identity.exposed():  # the CI's identity is in the environment for this exchange alone
            return trusted_publishing.mint_credentials(oidc_base(target))
    if target.token_block is None:
        raise ConfigError(f"publish.targets.{name}: no token_block and trusted_publishing is off")
    return IndexCredentials(target.username, secret(target.token_block))
