"""Install a requirement from an index with pip or uv into a fresh virtual environment.

:func:`index_options` and :func:`pip_steps` are the one place that knows
how each tool is told which indexes to use so that a name the Kiln index
holds installs from it alone; the install hint at the end of a run
(:mod:`kiln.flows.report.hint`) and the installs of :mod:`kiln.release.read.verify`
both take their options from them.

A Kiln index holds the project's own wheels, not its dependencies (torch,
triton, numpy…). Two ways to install from it:

* with extra indexes (``--extra-index-url``, e.g. PyPI or a company mirror):
  dependencies are resolved for real into an isolated venv;
* without: ``--no-deps`` of the project and the dependencies the index
  holds (``kiln-runtime``, pins) into a venv that sees this interpreter's
  site-packages (editable installs included) after its own, so the import
  still proves that the wheels from the index are the ones that load,
  without downloading gigabytes that are not under test.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from kiln.core.errors import InvalidInputError
from kiln.core.installenv import run_installer
from kiln.core.venvs import PURELIB_QUERY, layer, uv_command, venv_command

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
    held: tuple[str, ...] = ()  # the requirement's own Requires-Dist lines naming projects the index holds

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

    uv ranks its ``--extra-index-url`` above its ``--index-url``; with its
    first-index strategy (its default, stated so a configuration file cannot
    change it) it takes a project from the first index that has it, so there
    the index under test goes first (``--index``) and the last extra becomes
    uv's ``--default-index``. pip merges the candidates of every index, so
    for pip these options alone do not keep a held name on the index under
    test: :func:`pip_steps` does.
    """
    extras = list(extra_index_urls)
    if tool == "pip":
        return ["--index-url", index_url, *(flag for url in extras for flag in ("--extra-index-url", url))]
    if not extras:
        return ["--default-index", index_url]
    ranked = [index_url, *extras[:-1]]
    return ["--index-strategy", "first-index", *(flag for url in ranked for flag in ("--index", url)),
            "--default-index", extras[-1]]


# A printed command runs in the caller's shell, under the caller's installer configuration, and pip and uv
# both let that configuration add a source behind the ones a command names: pip.conf's or ``PIP_*``'s
# extra-index-url and find-links are merged with the command's indexes, so another index's same-version wheel
# with a more specific tag wins a name the Kiln index holds. pip's ``--isolated`` ignores every ``PIP_*``
# variable and the user's pip.conf, but still reads the global and the virtual environment's pip.conf and the
# file ``PIP_CONFIG_FILE`` names, unless that is the null device, which skips every file: the two together
# leave only the command line. uv's ``--no-config`` skips its uv.toml and pyproject.toml files, but not the
# file ``UV_CONFIG_FILE`` names nor uv's variables; of those, the command's own flags override the
# single-valued ones (``--index-strategy``, ``--default-index``) and ``--index`` replaces ``UV_INDEX``,
# while ``UV_EXTRA_INDEX_URL`` (ranked above a lone ``--default-index``), ``UV_FIND_LINKS`` (merged like
# pip's find-links) and ``UV_OVERRIDE`` (which can swap a name for a URL) add a source: ``env -u`` removes
# them for that one command. ``env`` rather than a shell's ``NAME=value cmd`` form, so fish reads it too.
# ``kiln verify --hint`` judges a command under the caller's own configuration as well.
PIP_ISOLATED: tuple[str, ...] = ("env", f"PIP_CONFIG_FILE={os.devnull}", "pip", "install", "--isolated")
UV_UNSET = ("UV_CONFIG_FILE", "UV_INDEX", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_OVERRIDE")
UV_ISOLATED: tuple[str, ...] = ("env", *(flag for name in UV_UNSET for flag in ("-u", name)),
                                "uv", "pip", "install", "--no-config")


def printed_pip(steps: Sequence[Sequence[str]]) -> str:
    """The shell command a user pastes for the ``pip install`` arguments of ``steps`` (:func:`pip_steps`), each
    step isolated from the caller's pip configuration, joined by ``&&``."""
    return " && ".join(shlex.join([*PIP_ISOLATED, *step]) for step in steps)


def printed_uv(arguments: Sequence[str]) -> str:
    """The shell command a user pastes for the ``uv pip install`` ``arguments``, isolated from uv's
    configuration files and from the variables that add a source."""
    return shlex.join([*UV_ISOLATED, *arguments])


# The same, for the installs Kiln runs itself: :func:`~kiln.core.installenv.scrubbed_env` already drops the
# variables that add an index and points ``HOME`` away from the user's files; these null the configuration
# files a variable can still name (and an overrides file), so no file adds a source either.
ISOLATED_ENV = {"PIP_CONFIG_FILE": os.devnull, "UV_CONFIG_FILE": os.devnull, "UV_OVERRIDE": os.devnull}


def held_requirements(requires: Iterable[str], held: Iterable[str]) -> list[str]:
    """The ``Requires-Dist`` lines of ``requires`` naming a project of ``held`` (what the Kiln index holds:
    ``kiln-runtime``, pins), as the wheel states them; lines only an extra asks for, and unparsable ones
    (pip refuses those when it installs the wheel), are left out."""
    names = {canonicalize_name(name) for name in held}
    found = []
    for text in requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        optional = requirement.marker is not None and "extra" in str(requirement.marker)
        if not optional and canonicalize_name(requirement.name) in names:
            found.append(text)
    return found


def pip_steps(index_url: str, requirement: str, held: Sequence[str] = (),
              extra_index_urls: Sequence[str] = ()) -> list[list[str]]:
    """The arguments of each ``pip install`` that installs ``requirement`` with held names from ``index_url`` only.

    pip takes any index's file for any name (a higher version, or the same version with a more specific tag),
    so one command with ``--extra-index-url`` lets another index shadow the Kiln index. Two steps cannot: the
    first installs ``requirement`` and the names of ``held`` (its own ``Requires-Dist`` lines naming projects
    the Kiln index holds: ``kiln-runtime``, pins) from the Kiln index alone, with ``--no-deps``; the second
    resolves the rest with the extra indexes, and pip keeps an installed distribution that satisfies a
    requirement, so what the first step installed is not replaced. Without extra indexes one step suffices.
    """
    if not extra_index_urls:
        return [["--index-url", index_url, requirement]]
    return [["--index-url", index_url, "--no-deps", requirement, *held],
            index_options("pip", index_url, extra_index_urls) + [requirement]]


def _run(cmd: list[str], timeout: float, what: str, cwd: Path) -> str:
    """Run ``cmd`` in ``cwd`` (a directory of Kiln's own, never the caller's: see :func:`python_command`),
    in the scrubbed environment every installer gets (:mod:`kiln.core.installenv`)."""
    try:
        done = run_installer(cmd, cwd, timeout, ISOLATED_ENV)
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


def _inherit(python: Path, timeout: float, cwd: Path) -> str:
    """Let the venv at ``python`` see this interpreter's site-packages, after its own.

    Through :func:`site.addsitedir`, not a bare path line: that also runs the ``.pth`` files there, so an
    editable install (a setuptools ``__editable__`` finder, a path ``.pth``) is visible as it is here.
    Its finders go after the venv's own path entries, so what the venv installed from the index still wins.
    """
    query = [*python_command(python), "-c", PURELIB_QUERY]
    try:
        done = run_installer(query, cwd, timeout)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"cannot locate the fresh venv's site-packages: {exc}"
    if done.returncode != 0:
        return f"cannot locate the fresh venv's site-packages: {done.stderr.strip()[-500:]}"
    layer(Path(done.stdout.strip()), "zz_kiln_parent", sysconfig.get_paths()["purelib"], run_pth=True)
    return "ok"


def install_commands(tool: Tool, python: Path, spec: InstallSpec) -> list[list[str]]:
    """The install commands for the venv of ``python``, in order: wheels only (nothing is built while
    checking), and every name the index holds from it alone (:func:`pip_steps`, uv's first index)."""
    if tool == "pip":
        pip = [*python_command(python), "-m", "pip", "install", "--no-cache-dir", "--only-binary", ":all:"]
        if not spec.resolves_dependencies:  # pip would keep an inherited copy of the same project
            return [[*pip, "--ignore-installed", "--no-deps", "--index-url", spec.index_url, spec.requirement,
                     *spec.held]]
        return [[*pip, *step] for step in pip_steps(spec.index_url, spec.requirement, spec.held,
                                                    spec.extra_index_urls)]
    preview = ["--preview-features", "wheel-variants"] if spec.wheel_variants else []
    uv = [*uv_command(), "pip", "install", "--no-config", *preview, "--no-cache", "--no-build", "--python", str(python),
          *index_options(tool, spec.index_url, spec.extra_index_urls)]
    if not spec.resolves_dependencies:
        return [[*uv, "--no-deps", spec.requirement, *spec.held]]
    return [[*uv, spec.requirement]]


def install_and_import(tool: Tool, spec: InstallSpec, workdir: Path, timeout: float) -> str:
    """Create a venv in ``workdir``, install ``spec`` with ``tool``, import its module: "ok" or what failed.

    Every command runs in an empty directory of its own under ``workdir``
    and every interpreter in isolated mode, so nothing in the caller's
    directory can be imported in place of the wheel under test.
    """
    venv, cwd = workdir / f"{tool}-venv", workdir / f"{tool}-cwd"
    cwd.mkdir(exist_ok=True)
    result = _run(venv_command(venv, pip=tool == "pip", uv=tool != "pip"), timeout, f"{tool}: create venv", cwd)
    if result != "ok":
        return result
    python = venv / "bin" / "python"
    if not spec.resolves_dependencies:
        result = _inherit(python, timeout, cwd)
        if result != "ok":
            return f"{tool}: {result}"
    for command in install_commands(tool, python, spec):
        result = _run(command, timeout, f"{tool}: install {spec.requirement}", cwd)
        if result != "ok":
            return result
    if not spec.modules:
        return "ok"
    check = (f"import importlib, sys; mods = [importlib.import_module(m) for m in {list(spec.modules)!r}]; "
             f"sys.exit(0 if all((getattr(m, '__file__', None) or '').startswith({str(venv)!r}) for m in mods) else 3)")
    return _run([*python_command(python), "-c", check], timeout,
                f"{tool}: import {', '.join(spec.modules)} from the fresh venv", cwd)
