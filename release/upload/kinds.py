"""The upload kinds by name: each kind's uploader and config model as ``"module:attr"`` strings, in one table.

Kept apart from :mod:`kiln.release.upload.uploaders` and importing nothing of Kiln,
because every process that reads kiln.toml validates its upload targets, the
bench harness and the test server inside a wheel's environment included, where
twine and wheel (which the uploaders import) are not installed. So an entry
names both halves of a kind without importing either: kiln.toml's loader
imports the ``config`` model only (its module must import neither twine nor
wheel), the release's uploaders table the ``uploader`` only, each on first use.
A new kind is its module and one entry here.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from kiln.core import entrypoints


class UploadKind(NamedTuple):
    """One kind's two halves, each ``"module:attr"``."""

    uploader: str  # a zero-argument callable (a class) making its kiln.release.upload.uploaders.Uploader
    config: str  # the pydantic model of its [publish.targets.<name>] table, with kind: Literal["<its kind>"]


@runtime_checkable
class UploadTargetConfig(Protocol):
    """What the release reads of a ``[publish.targets.<name>]`` table of any kind; its model holds the rest.

    The release plans and sends through these keys alone, so every kind's model has them (checked at load);
    only the kind's own uploader reads its other keys (where credentials come from, say)."""

    @property
    def kind(self) -> str: ...
    @property
    def url(self) -> str: ...  # where files are sent
    @property
    def index_url(self) -> str: ...  # where the uploader reads what the index holds
    @property
    def pypi_variant(self) -> str: ...  # the one variant whose wheels go there
    @property
    def sdist(self) -> bool: ...  # whether the project's sdist goes too
    @property
    def size_limit_mib(self) -> int: ...
    @property
    def quota_gib(self) -> float: ...
    @property
    def timeout_s(self) -> float: ...  # one file's send


# kind (as kiln.toml spells it) -> its uploader and its config model.
UPLOAD_KINDS: dict[str, UploadKind] = {
    "upload": UploadKind(  # a PyPI-compatible index's legacy upload API, through twine
        "kiln.release.upload.uploaders:PyPIUploader", "kiln.tasks.project.config_publish:UploadTarget"),
}


def load(spec: str) -> object:
    """What ``spec`` (``"module:attr"``) names, importing its module; ValueError naming the entry otherwise."""
    try:
        return entrypoints.load(spec)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"its entry {spec!r} in kiln.release.upload.kinds.UPLOAD_KINDS names nothing importable"
                         f" ({exc}); an entry is 'module:attr'") from exc


__all__ = ["UPLOAD_KINDS", "UploadKind", "UploadTargetConfig", "load"]
