"""Install a requirement from an index with pip or uv into a fresh virtual environment.

:func:`index_options` is the one place that knows how each tool is told
which indexes to use; the install hint at the end of a run
(:mod:`kiln.flows.summary`) and the installs of :mod:`kiln.release.verify`
both take their options from it.

A Kiln index holds the project's own wheels, not its dependencies (torch,
triton, numpy…). Two ways to install from it:

* with extra indexes (``--extra-index-url``, e.g. PyPI or a company mirror):
  dependencies are resolved for real into an isolated venv;
* without: ``--no-deps`` into a venv that sees this interpreter's
  site-packages through a ``.pth`` file placed after its own, so the import
  still proves that the wheel from the index is the one that loads, without
  downloading gigabytes that are not under test.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args
from urllib.parse import urlsplit

from kiln.release.errors import InvalidInputError

log = logging.getLogger(__name__)

Tool = Literal["pip", "uv"]
TOOLS: tuple[Tool, ...] = get_args(Tool)


@dataclass(frozen=True)
class InstallSpec:
    """What to install, from where, and how dependencies are handled."""

    index_url: str
    requirement: str  # "name==version"
    modules: tuple[str, ...]  # imported afterwards (read from the wheel); each must load from the fresh venv
    extra_index_urls: tuple[str, ...] = ()
    wheel_variants: bool = False  # uv chooses among PEP 825 variant wheels (its preview feature)

    @property
    def resolves_dependencies(self) -> bool:
        return bool(self.extra_index_urls)


def check_index_url(url: str) -> str:
    """An index URL pip and uv both read (http, https, file); InvalidInputError naming it otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "file") or (parts.scheme != "file" and not parts.netloc):
        raise InvalidInputError(f"index URL {url!r}: pip and uv read http://, https:// or file:/// indexes")
    if any(ord(ch) < 33 for ch in url):
        raise InvalidInputError(f"index URL {url!r} contains a space or control character")
    return url


def index_options(tool: Tool, index_url: str, extra_index_urls: Sequence[str] = ()) -> list[str]:
    """The index options of ``tool``, with ``index_url`` winning for every project it holds.

    pip merges ``--index-url`` and ``--extra-index-url`` candidates. uv ranks
    its ``--extra-index-url`` above its ``--index-url`` and takes a project
    from the first index that has it, so there the index under test goes
    first (``--index``) and the last extra becomes uv's ``--default-index``.
    """
    extras = list(extra_index_urls)
    if tool == "pip":
        return ["--index-url", index_url, *(flag for url in extras for flag in ("--extra-index-url", url))]
    if not extras:
        return ["--default-index", index_url]
    ranked = [index_url, *extras[:-1]]
    return [*(flag for url in ranked for flag in ("--index", url)), "--default-index", extras[-1]]


def _run(cmd: list[str], timeout: float, what: str, cwd: Path) -> str:
    """Run ``cmd`` in ``cwd`` (a directory of Kiln's own, never the caller's: see :func:`python_command`)."""
    log.info("running %s (in %s)", " ".join(cmd), cwd)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return f"{what}: timed out after {timeout:.0f} s"
    except OSError as exc:
        return f"{what}: cannot run {cmd[0]}: {exc}"
    if done.returncode != 0:
        return f"{what}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-1500:]}"
    return "ok"


def python_command(python: str | Path) -> list[str]:
    """An interpreter in isolated mode (``-I``): neither the working directory nor the script's directory
    is on its import path, and no ``PYTHON*`` variable changes it, so a module planted where ``kiln verify``
    was started (named like the wheel's package, or like ``venv``) is never imported."""
    return [str(python), "-I"]


def uv_command() -> list[str]:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [*python_command(sys.executable), "-m", "uv"]


def _inherit(python: Path, timeout: float, cwd: Path) -> str:
    """Let the venv at ``python`` see this interpreter's site-packages, after its own."""
    query = [*python_command(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    log.info("running %s (in %s)", " ".join(query), cwd)
    try:
        purelib = subprocess.run(query, capture_output=True, text=True, timeout=timeout, check=True,
                                 cwd=cwd).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return f"cannot locate the fresh venv's site-packages: {exc}"
    # after the venv's own site-packages, so the wheel installed from the index wins
    Path(purelib, "zz_kiln_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return "ok"


def install_command(tool: Tool, python: Path, spec: InstallSpec) -> list[str]:
    """The install command line for the venv of ``python``."""
    flags = [] if spec.resolves_dependencies else ["--no-deps"]
    if tool == "pip" and not spec.resolves_dependencies:
        flags.append("--ignore-installed")  # pip would keep an inherited copy of the same project
    options = index_options(tool, spec.index_url, spec.extra_index_urls)
    if tool == "pip":
        return [*python_command(python), "-m", "pip", "install", "--no-cache-dir", *options, *flags, spec.requirement]
    preview = ["--preview-features", "wheel-variants"] if spec.wheel_variants else []
    return [*uv_command(), "pip", "install", *preview, "--no-cache", "--python", str(python), *options, *flags,
            spec.requirement]


def install_and_import(tool: Tool, spec: InstallSpec, workdir: Path, timeout: float) -> str:
    """Create a venv in ``workdir``, install ``spec`` with ``tool``, import its module: "ok" or what failed.

    Every command runs in an empty directory of its own under ``workdir``
    and every interpreter in isolated mode, so nothing in the caller's
    directory can be imported in place of the wheel under test.
    """
    venv, cwd = workdir / f"{tool}-venv", workdir / f"{tool}-cwd"
    cwd.mkdir(exist_ok=True)
    create = ([*python_command(sys.executable), "-m", "venv", str(venv)] if tool == "pip" else
              [*uv_command(), "venv", "--python", sys.executable, str(venv)])
    result = _run(create, timeout, f"{tool}: create venv", cwd)
    if result != "ok":
        return result
    python = venv / "bin" / "python"
    if not spec.resolves_dependencies:
        result = _inherit(python, timeout, cwd)
        if result != "ok":
            return f"{tool}: {result}"
    result = _run(install_command(tool, python, spec), timeout, f"{tool}: install {spec.requirement}", cwd)
    if result != "ok":
        return result
    if not spec.modules:
        return "ok"
    check = (f"import importlib, sys; mods = [importlib.import_module(m) for m in {list(spec.modules)!r}]; "
             f"sys.exit(0 if all((getattr(m, '__file__', None) or '').startswith({str(venv)!r}) for m in mods) else 3)")
    return _run([*python_command(python), "-c", check], timeout,
                f"{tool}: import {', '.join(spec.modules)} from the fresh venv", cwd)
