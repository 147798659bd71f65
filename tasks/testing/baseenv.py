"""The shared base of test and bench environments: the variant's large dependencies, made once.

A suite's environment (:mod:`.envs`) must not download torch for every run,
nor see Kiln's own site-packages. Its large shared dependencies — torch,
Triton, numpy, pytest and the pydantic Kiln's bench harness reads its
configuration with — come from a base environment keyed by their exact
versions and the interpreter: :func:`kiln.tasks.build.buildenv.ensure_env`
makes it once (pip, from the machine's ``pip.conf`` sources, so torch is the
local CPU build; under an ``fcntl`` lock, in a temporary directory renamed
into place), and every suite environment of that key layers its
site-packages after its own. The versions are those of Kiln's interpreter
(what Kiln itself was tested with); a GPU variant's base takes the torch its
``build_requires`` pins instead.

Where: ``$KILN_TEST_ENV_CACHE`` (the tests point it at one directory per
user), else ``~/.cache/kiln/test-envs``.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kiln.tasks.build.buildenv import ensure_env, pinned_version

log = logging.getLogger(__name__)

CACHE_ENV = "KILN_TEST_ENV_CACHE"
# The large dependencies a kernel package's suite shares, and what Kiln's harness needs inside the environment.
BASE_DISTRIBUTIONS = ("torch", "triton", "numpy", "pytest", "pydantic")
CREATE_TIMEOUT_S = 1800.0  # a cold base: torch and Triton from pip's sources


@dataclass(frozen=True)
class BaseEnv:
    """A made base environment: its root, its site-packages, the pins it was made from."""

    root: Path
    site: Path
    pins: tuple[str, ...]


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kiln" / "test-envs"


def base_pins(backend: str = "cpu", build_requires: Sequence[str] = ()) -> tuple[str, ...]:
    """``name==version`` of each base distribution Kiln's interpreter has; a GPU variant's torch pin wins."""
    pins = []
    for name in BASE_DISTRIBUTIONS:
        pinned = pinned_version(build_requires, name) if backend != "cpu" else None
        try:
            version = pinned or metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        pins.append(f"{name}=={version}")
    return tuple(pins)


def site_packages(root: Path) -> Path:
    """The purelib directory of the environment at ``root`` (made by this interpreter)."""
    return Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))


def base_env(pins: Sequence[str], variant: str = "cpu") -> BaseEnv:
    """The base environment of ``pins`` (made now, or found); its creation is logged with its time."""
    start = time.perf_counter()
    log.info("test base environment of %s (%s): finding or creating it under %s (a cold one takes minutes)",
             variant, ", ".join(pins), cache_root())
    made = ensure_env(cache_root(), pins, variant, CREATE_TIMEOUT_S)
    log.info("test base environment %s %s in %.1f s", made.root.name[:16], "created" if made.created else "found",
             time.perf_counter() - start)
    return BaseEnv(made.root, site_packages(made.root), made.requirements)

