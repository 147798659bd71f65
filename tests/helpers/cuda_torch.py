"""The CUDA-torch build environment tests share: made once per machine, under a stable temporary directory.

A project under test gets it by :func:`link_shared_envs` (its build cache's ``envs/`` points there), so no
test makes its own 5.5 GB copy; the first session to need it makes it (about 2 minutes), the rest find it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from kiln.tasks.build.buildenv import BuildEnvironment, ensure_env

CUDA_TORCH = "torch==2.14.1"
_log = logging.getLogger("kiln.tests")


def shared_envs_root() -> Path:
    return Path(tempfile.gettempdir()) / f"kiln-test-buildenvs-{os.getuid()}"


def shared_cuda_torch_env() -> BuildEnvironment:
    """The shared CUDA-torch environment, made (cold) or found (warm); the time is logged."""
    start = time.perf_counter()
    made = ensure_env(shared_envs_root(), [CUDA_TORCH], "cu130", 3600)
    _log.warning("CUDA-torch build environment %s %s in %.1f s", made.root, "created" if made.created else "found",
                 time.perf_counter() - start)
    return made


def shared_cuda_torch_envs() -> Path:
    """The shared directory, its CUDA-torch environment made (cold) or found (warm)."""
    shared_cuda_torch_env()
    return shared_envs_root()


def link_shared_envs(project: Path, envs: Path, cache_dir: str = ".kiln/cache") -> None:
    """Make ``project``'s build cache find its variant environments in ``envs``."""
    cache = project / cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "envs").symlink_to(envs)
