"""``kiln policies --out DIR``: one least-privilege IAM policy per step."""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.core.fsutil import atomic_write_text
from kiln.release.stores.policies import policies_from_config, render
from kiln.tasks.project.config import KilnConfig, load_config

log = logging.getLogger(__name__)


def policies_command(config_path: str, out: str, target: str | None = None) -> int:
    """Write ``out/<step>.json`` for every step in ``[permissions]``; return 0.

    Every document is generated (and validated) before the first file is
    written, so a bad kiln.toml raises :class:`ConfigError` and changes nothing.
    """
    return write_policies(load_config(config_path), out, target)


def write_policies(config: KilnConfig, out: str, target: str | None = None) -> int:
    """:func:`policies_command` for a loaded config."""
    documents = policies_from_config(config, target)
    directory = Path(out)
    for step, document in documents.items():
        path = directory / f"{step}.json"
        atomic_write_text(path, render(document))
        log.info("wrote the %s policy to %s", step, path)
    return 0
