"""A fresh environment per variant: the suite runs against the wheel that ships.

:func:`make_env` creates a virtual environment (``uv venv``), installs the
variant's wheel into it from the run record, and checks that every
requirement of the wheel and of the suite is met. The heavy third-party
stack a kernel package needs (torch, triton, numpy, pytest) is not
downloaded again for every run: the environment sees this interpreter's
site-packages through a ``.pth`` file *after* its own, so the wheel installed
into the environment is what ``import`` finds, never the project's source
tree. Kiln's own test helpers (``kiln.tasks.testing``: the worker, the
distributed runner) are made importable the same way Kiln is installed here
— never by putting Kiln's checkout on a path.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from collections.abc import Sequence

from kiln.release.errors import InfrastructureError, ToolchainMissingError

log = logging.getLogger("kiln.test.envs")

TIMEOUT_S = 300.0
# Kiln's own distributions the test processes import (the worker, the spec types).
KILN_DISTRIBUTIONS = ("kiln", "kiln-runtime")

# Run inside the new environment: which requirements are not met there.
_CHECK = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
missing = []
for text in json.loads(sys.argv[1]):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        found = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(f"{text} (not installed)")
        continue
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        missing.append(f"{text} (found {found})")
print(json.dumps(missing))
"""


@dataclass(frozen=True)
class TestEnv:
    """A prepared environment: its interpreter and what was installed into it."""

    __test__ = False  # not a pytest test class

    root: Path
    python: Path
    installed: tuple[str, ...]


def _uv() -> list[str]:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "uv"]


def _run(cmd: list[str], what: str, timeout: float = TIMEOUT_S) -> str:
    log.info("running %s", " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"{what} did not finish within {timeout:g}s") from exc
    except FileNotFoundError as exc:
        raise ToolchainMissingError(f"{what}: {cmd[0]} is not installed") from exc
    if done.returncode != 0:
        raise InfrastructureError(
            f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}"
        )
    return done.stdout


def _editable_pth(distribution: str) -> str | None:
    """The ``.pth`` line an editable install of ``distribution`` put into site-packages, if any."""
    # Looked up in this interpreter's site-packages only: a ``kiln.egg-info`` left in the working
    # directory (an in-tree build) would otherwise answer first, without the editable install's files.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = list(metadata.distributions(name=distribution, path=site))
    if not found:
        return None
    files = found[0].files or []
    for file in files:
        if file.name.endswith(".pth") and file.name.startswith("__editable__"):
            return Path(str(file.locate())).read_text()
    return None


def _site_packages(python: Path) -> Path:
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               "locating the environment's site-packages")
    return Path(out.strip())


def _link_parent(site: Path) -> None:
    """See this interpreter's packages after the environment's own; expose Kiln as installed here."""
    parent = sysconfig.get_paths()["purelib"]
    (site / "zz_kiln_inherit.pth").write_text(parent + "\n")
    for distribution in KILN_DISTRIBUTIONS:
        line = _editable_pth(distribution)
        if line is not None:  # an editable Kiln: its import hook maps only kiln.* (no checkout on a path)
            (site / f"zzz_kiln_{distribution.replace('-', '_')}.pth").write_text(line)


def unmet_requirements(python: Path, requirements: Sequence[str]) -> list[str]:
    return json.loads(_run([str(python), "-c", _CHECK, json.dumps(list(requirements))],
                           "checking the environment's requirements").strip() or "[]")


def wheel_requirements(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel (read with the standard library's email parser)."""
    import email.parser
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.BytesParser().parsebytes(archive.read(name))
    return message.get_all("Requires-Dist") or []


def make_build_env(root: Path) -> Path:
    """A fresh environment at ``root`` that sees this interpreter's packages after its own; its python.

    The test environments start from it, and so does a project's own build backend (``[build] backend = "pep517"``).
    """
    if root.exists():
        shutil.rmtree(root)
    _run([*_uv(), "venv", "--quiet", "--python", sys.executable, str(root)], f"creating {root}")
    python = root / "bin" / "python"
    _link_parent(_site_packages(python))
    return python


def make_env(root: Path, wheels: Sequence[Path], requirements: Sequence[str] = ()) -> TestEnv:
    """A fresh environment at ``root`` with ``wheels`` installed; every requirement met or an error naming it."""
    python = make_build_env(root)
    _run([*_uv(), "pip", "install", "--quiet", "--offline", "--no-deps", "--python", str(python),
          *map(str, wheels)], f"installing {', '.join(w.name for w in wheels)} into {root}")
    needed = [r for wheel in wheels for r in wheel_requirements(wheel)] + list(requirements)
    missing = unmet_requirements(python, needed)
    if missing:
        raise ToolchainMissingError(f"the test environment for {', '.join(w.name for w in wheels)} lacks "
                                    f"{'; '.join(missing)}; install them where Kiln runs")
    log.info("test environment %s: %s", root, ", ".join(w.name for w in wheels))
    return TestEnv(root, python, tuple(w.name for w in wheels))
