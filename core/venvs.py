"""Virtual environments, one way: the tool that makes and fills them, where their packages live, and how
one sees another's packages after its own.

**The isolation rule**, said once for every interpreter Kiln starts: the working directory and the
script's directory are never on its ``sys.path``, so a module planted where Kiln was started (named like a
wheel's package, like ``uv``, ``pip`` or ``venv``) is never imported in its place.

- Kiln's own interpreter, run for a tool (``python -m uv``, ``-m pip``, ``-m venv``), runs isolated
  (:data:`TOOL_ISOLATION`, ``-I``): the tool is in Kiln's environment, and nothing of the caller's
  ``PYTHON*`` variables or user site has a say in what it imports.
- An environment's interpreter, which runs the code under test or a build backend, gets ``-P``
  (Python 3.11+): the variables Kiln sets for that code still apply. Python 3.10 has no ``-P``, so a 3.10
  environment gets ``-I`` (:func:`safe_path_flag` reads which from its ``pyvenv.cfg``).

**Layers.** An environment sees another's packages after its own through one ``.pth`` file in its
site-packages (:func:`layer`): a plain path line (the other site-packages' modules only), or, with
``run_pth``, :func:`site.addsitedir` (its ``.pth`` files run too, so an editable install there works
here as it does there). Its own packages always win. :func:`make_build_env` is the one environment that
sees Kiln's interpreter this way (a project's own build backend builds in it); a test environment never does.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from kiln.core.errors import InfrastructureError, ToolchainMissingError

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0
TOOL_ISOLATION = "-I"
# Run by an environment's interpreter: the site-packages directory its packages install into.
PURELIB_QUERY = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
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


def safe_path_flag(python: str | Path) -> str:
    """How to keep the working directory off ``sys.path`` for ``python`` (an environment's interpreter):
    ``-P`` (3.11+), else ``-I`` (a Python 3.10 cell's environment; ``-P`` came with 3.11). Read from the
    environment's ``pyvenv.cfg``, no process; an interpreter outside an environment is taken as 3.11+."""
    config = Path(python).parent.parent / "pyvenv.cfg"
    try:
        lines = config.read_text().splitlines()
    except OSError:
        return "-P"
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() in ("version_info", "version"):
            parts = value.strip().split(".")
            if len(parts) >= 2 and parts[0] == "3" and parts[1].isdigit() and int(parts[1]) < 11:
                return "-I"
            return "-P"
    return "-P"


def run(cmd: list[str], what: str, timeout: float = TIMEOUT_S, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` (logged first); its stdout, or an :class:`InfrastructureError` saying ``what`` failed."""
    log.info("running %s", " ".join(cmd))
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"{what} did not finish within {timeout:g}s") from exc
    except FileNotFoundError as exc:
        raise ToolchainMissingError(f"{what}: {cmd[0]} is not installed") from exc
    if done.returncode != 0:
        raise InfrastructureError(
            f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}"
        )
    return done.stdout


def tool_python() -> list[str]:
    """Kiln's own interpreter, isolated, to run a tool module with (``[*tool_python(), "-m", "pip", …]``)."""
    return [sys.executable, TOOL_ISOLATION]


def uv_command() -> list[str]:
    """uv: the ``uv`` on ``PATH``, else the one installed beside Kiln's interpreter, else ``python -I -m uv``."""
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [*tool_python(), "-m", "uv"]


def layer(site: Path, name: str, parent: str | Path, *, run_pth: bool = False) -> Path:
    """Let the environment whose site-packages is ``site`` see ``parent``'s packages after its own.

    ``name`` names the ``.pth`` file (``.pth`` files run in name order: ``zz_…`` comes after what the
    environment installed itself). ``run_pth``: through :func:`site.addsitedir`, so ``parent``'s own ``.pth``
    files (an editable install's finder) run too; else a plain path line. Returns the file written.
    """
    line = f"import site; site.addsitedir({str(parent)!r})" if run_pth else str(parent)
    path = site / f"{name}.pth"
    path.write_text(line + "\n")
    return path


def site_packages(python: Path) -> Path:
    """The site-packages directory of the environment whose interpreter is ``python``."""
    out = run([str(python), safe_path_flag(python), "-c", PURELIB_QUERY], "locating the environment's site-packages")
    return Path(out.strip())


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


def layer_kiln(site: Path) -> None:
    """See this interpreter's packages after the environment's own; expose Kiln as installed here."""
    layer(site, "zz_kiln_inherit", sysconfig.get_paths()["purelib"])
    for distribution in KILN_DISTRIBUTIONS:
        line = _editable_pth(distribution)
        if line is not None:  # an editable Kiln: its import hook maps only kiln.* (no checkout on a path)
            (site / f"zzz_kiln_{distribution.replace('-', '_')}.pth").write_text(line)


def venv_command(root: Path, python: str | Path | None = None, *, pip: bool = False, uv: bool = False) -> list[str]:
    """The command that makes a fresh virtual environment at ``root``: the one way Kiln makes one.

    ``python``: the interpreter it runs (default Kiln's; an environment's python makes one on its base).
    ``uv``: by uv (about ten times faster than ``venv``; no pip in it). Else by the interpreter's own ``venv``,
    isolated (``-I``: nothing of the working directory is imported in place of ``venv``), with pip from its
    ``ensurepip`` (``pip``: offline), or without pip.
    """
    interpreter = str(python or sys.executable)
    if uv:
        if pip:
            raise ValueError("uv venv makes no pip: ask for pip=False, or for the interpreter's venv")
        return [*uv_command(), "venv", "--quiet", "--python", interpreter, str(root)]
    return [interpreter, TOOL_ISOLATION, "-m", "venv", *(() if pip else ("--without-pip",)), str(root)]


def create_env(root: Path, python: str | Path | None = None, *, pip: bool = False, uv: bool = False,
               timeout: float = TIMEOUT_S) -> Path:
    """A fresh virtual environment at ``root`` (:func:`venv_command`); its python. An
    :class:`InfrastructureError` names ``root`` when it cannot be made."""
    run(venv_command(root, python, pip=pip, uv=uv), f"creating the environment {root}", timeout)
    return root / "bin" / "python"


def make_build_env(root: Path) -> Path:
    """A fresh environment at ``root`` that sees this interpreter's packages after its own; its python.

    A project's own build backend (``[build] backend = "pep517"``) builds in it; test environments do not
    (:func:`kiln.tasks.testing.envs.make_env`).
    """
    if root.exists():
        shutil.rmtree(root)
    python = create_env(root, uv=True)
    layer_kiln(site_packages(python))
    return python


def unmet_requirements(python: Path, requirements: Sequence[str], flag: str = "-P") -> list[str]:
    """The requirements the environment of ``python`` does not meet, each with why (absent, or the version)."""
    # -P: the caller's working directory (any directory a user runs kiln in) is not on the path.
    unmet: list[str] = json.loads(run([str(python), flag, "-c", _CHECK, json.dumps(list(requirements))],
                                      "checking the environment's requirements").strip() or "[]")
    return unmet
