"""This package's precompiled Triton artifacts, through Kiln's shipped loader.

The build stage writes ``kiln_kernels/_aot/manifest.json`` into every GPU
wheel; :class:`kiln.runtime.loader.Loader` (from the ``kiln-runtime``
distribution published beside this wheel) picks the artifact for the device,
verifies its hash and Triton version, and falls back to Triton's JIT with
one warning. A source checkout has no manifest: every op JITs.
"""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.loader import Device, Loader
from kiln_kernels.platform import Platform

AOT_DIR = Path(__file__).resolve().parent / "_aot"
LOADER = Loader(AOT_DIR)


def device(platform: Platform) -> Device:
    """The loader's view of a platform."""
    return Device(platform.backend, platform.arch, platform.triton_version, platform.interpreter)
