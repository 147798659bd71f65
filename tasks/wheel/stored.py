"""What the wheel steps keep of their work in Kiln's build cache, as a protocol: the steps sit below the build
stage, whose :class:`~kiln.tasks.build.cache.BuildCache` is the one implementation (an audit's verdict, an SBOM,
an assembled wheel, stored under a key of what they were made from)."""

from __future__ import annotations

from typing import Protocol


class ResultCache(Protocol):
    """A content-addressed store of named files under (batch, key)."""

    def file(self, batch: str, key: str, name: str) -> bytes | None:
        """The verified bytes of one stored file; None on a miss."""
        ...

    def put(self, batch: str, key: str, files: dict[str, bytes], info: dict[str, object] | None = None) -> None:
        """Store ``files`` under ``key``."""
        ...


__all__ = ["ResultCache"]
