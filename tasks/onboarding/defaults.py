"""``kiln init``'s defaults where a package says nothing (the CUDA variant's name, torch and archs, the JIT
variant's interpreter requirements, the publish URL): data, in ``defaults.toml`` beside this module."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_DEFAULTS = Path(__file__).with_name("defaults.toml")


@dataclass(frozen=True)
class Defaults:
    cuda_variant: str
    cuda_torch: str
    extension_archs: tuple[str, ...]
    registry_archs: tuple[str, ...]
    cpu_variant: str
    jit_variant: str
    interpreter_requires: tuple[str, ...]
    publish_url: str


@cache
def load_defaults(path: Path = _DEFAULTS) -> Defaults:
    data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    cuda, jit = data["cuda"], data["triton_jit"]
    return Defaults(cuda["variant"], cuda["torch"], tuple(cuda["extension_archs"]), tuple(cuda["registry_archs"]),
                    data["cpu"]["variant"], jit["variant"], tuple(jit["interpreter_requires"]),
                    data["publish"]["url"])
