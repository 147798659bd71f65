"""kiln.toml's upload targets ([publish.targets.<name>] kind = "upload") as the release library's requests.

Plain functions (no Prefect): :mod:`kiln.flows.pypi` wraps them in task runs.
"""

from __future__ import annotations

from kiln.release.errors import ConfigError
from kiln.release.manifest import RunManifest
from kiln.release.pypi_plan import GIB, MIB, Limits
from kiln.release.pypi_release import UploadRequest
from kiln.release.upload import Endpoint
from kiln.tasks.project.config import KilnConfig, UploadTarget


def upload_target(config: KilnConfig, name: str) -> UploadTarget:
    targets = config.publish.upload_targets
    if name not in targets:
        raise ConfigError(f"unknown upload target {name!r}; kiln.toml defines {sorted(targets) or 'none'}"
                          " ([publish.targets.<name>] with kind = \"upload\")")
    return targets[name]


def endpoint(config: KilnConfig, name: str) -> Endpoint:
    target = upload_target(config, name)
    return Endpoint(name, target.url, target.index_url, target.timeout_s)


def upload_request(config: KilnConfig, manifest: RunManifest, name: str, version: str) -> UploadRequest:
    """The PyPI variant's wheels of the run (each checked against the sha256 the run recorded) for ``name``."""
    target = upload_target(config, name)
    wheels = tuple(manifest.verify(a) for a in manifest.artifacts_of("wheel", target.pypi_variant)
                   if a.state == "ok")
    limits = Limits(target.size_limit_mib * MIB, int(target.quota_gib * GIB))
    return UploadRequest(endpoint(config, name), config.project.distribution, version, target.pypi_variant,
                         wheels, (), limits)


def missing_tokens(config: KilnConfig) -> list[str]:
    """One line per upload target that names no Secret block for its API token (a real release refuses)."""
    return [f"publish.targets.{name}: no token_block names the Prefect Secret block holding its API token;"
            f" a release cannot upload there (create the block, then set token_block = \"<block name>\")"
            for name, target in sorted(config.publish.upload_targets.items()) if target.token_block is None]
