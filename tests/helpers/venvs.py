"""Fresh virtual environments for install tests.

The kernel wheels import torch; installing a multi-gigabyte torch into every
fresh venv is not what is under test. The venv instead sees the test
environment's site-packages through a ``.pth`` file, the wheel itself is
installed with ``--no-deps``, and the tests check that the imported package
comes from the fresh venv. The venv is made without pip of its own: ensurepip
installing pip into it took 5 s idle and up to 27 s on a loaded machine, per
venv. ``python -m pip`` in it is the test environment's pip (through the same
``.pth``), which installs into the venv it runs in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

TIMEOUT_S = 300


def make_venv(path: Path) -> Path:
    """Create a venv at ``path`` that can import the parent's packages; return its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=TIMEOUT_S)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=TIMEOUT_S,
    ).stdout.strip()
    # Appended after the venv's own site-packages, so the freshly installed wheel wins.
    Path(purelib, "zz_parent_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, **kwargs)
