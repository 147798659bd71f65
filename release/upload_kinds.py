"""The upload kinds by name, as ``"module:attr"`` strings: the table kiln.toml's loader checks a kind against.

Kept apart from :mod:`kiln.release.uploaders` and importing nothing, because
every process that reads kiln.toml checks its upload kinds, the bench harness
and the test server inside a wheel's environment included, where twine and
wheel (which the uploaders import) are not installed. ``attr`` names a
zero-argument callable (a class) that makes the kind's
:class:`~kiln.release.uploaders.Uploader`; the uploaders' table resolves it
on first use. A new kind is its module and one entry here.
"""

from __future__ import annotations

# kind (as kiln.toml spells it) -> "module:attr" of the factory of its uploader.
UPLOAD_KINDS: dict[str, str] = {
    "upload": "kiln.release.uploaders:PyPIUploader",  # a PyPI-compatible index's legacy upload API, through twine
}

__all__ = ["UPLOAD_KINDS"]
