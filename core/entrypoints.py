"""``"module:attr"`` strings: how Kiln's tables name code they import only when it is asked for (a compile
worker's target, an upload kind, an axis's toolchain)."""

from __future__ import annotations

import importlib


def load(spec: str) -> object:
    """What ``spec`` (``"package.module:attr"``) names, its module imported; ImportError or AttributeError as
    Python raises them, for the caller to say which table named it."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["load"]
