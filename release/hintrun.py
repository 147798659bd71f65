"""Run a printed install hint as a user would, and say which version it installed.

The hint a run prints (``pip install --index-url … --extra-index-url … NAME==VERSION``,
:func:`kiln.flows.hint.install_command`) is what users paste. pip merges the
candidates of every index it is given, so an unpinned name can install a
higher release from an extra index instead of what was published; only
running the hint shows which. :func:`run_hint` does so in a fresh virtual
environment, with its interpreter in isolated mode (``-I``), in an empty
working directory, with no pip configuration file, every command under a
timeout; :func:`check_hint` compares the installed version with the published one.

Only the options Kiln prints are accepted (``--index-url``/``-i``,
``--extra-index-url``) and exactly one requirement: anything else is refused
before anything runs, naming the hint.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.release.errors import InvalidInputError
from kiln.release.install import check_index_url, python_command

log = logging.getLogger(__name__)

_OPTIONS = {"--index-url", "-i", "--extra-index-url"}
_TAIL = 1500  # characters of a failed command's output in the report


@dataclass(frozen=True)
class Hint:
    """A parsed ``pip install`` hint: its options (as given) and its one requirement."""

    text: str
    options: tuple[str, ...]
    requirement: Requirement

    @property
    def project(self) -> str:
        return canonicalize_name(self.requirement.name)


def parse_hint(text: str) -> Hint:
    """The hint ``text`` as pip would read it; InvalidInputError naming it when it is not one Kiln prints."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise InvalidInputError(f"install hint {text!r}: {exc}") from exc
    if argv[:2] != ["pip", "install"]:
        raise InvalidInputError(f"install hint {text!r}: must start with 'pip install'")
    options: list[str] = []
    requirements: list[str] = []
    rest = iter(argv[2:])
    for arg in rest:
        flag, eq, value = arg.partition("=")
        if flag in _OPTIONS:
            url = value if eq else next(rest, "")
            try:
                options += [flag, check_index_url(url)]
            except InvalidInputError as exc:
                raise InvalidInputError(f"install hint {text!r}: {exc}") from exc
        elif arg.startswith("-"):
            raise InvalidInputError(f"install hint {text!r}: option {arg!r} is not one Kiln prints "
                                    f"({', '.join(sorted(_OPTIONS))})")
        else:
            requirements.append(arg)
    if len(requirements) != 1:
        raise InvalidInputError(f"install hint {text!r}: names {len(requirements)} requirements, not exactly one")
    try:
        requirement = Requirement(requirements[0])
    except InvalidRequirement as exc:
        raise InvalidInputError(f"install hint {text!r}: {exc}") from exc
    return Hint(text, tuple(options), requirement)


def _run(cmd: list[str], cwd: Path, timeout: float, what: str) -> tuple[bool, str]:
    """(succeeded, stdout or what failed) of ``cmd`` in ``cwd``, with no pip configuration of the caller's."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    log.info("running %s (in %s)", shlex.join(cmd), cwd)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return False, f"{what}: timed out after {timeout:.0f} s"
    except OSError as exc:
        return False, f"{what}: cannot run {cmd[0]}: {exc}"
    if done.returncode != 0:
        return False, f"{what}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-_TAIL:]}"
    return True, done.stdout


def run_hint(hint: Hint, workdir: Path, timeout: float) -> tuple[str | None, str]:
    """Run ``hint`` in a fresh venv under ``workdir``: (the version of its project it installed, or None; why not)."""
    venv, cwd = workdir / "venv", workdir / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    ok, out = _run([*python_command(sys.executable), "-m", "venv", str(venv)], cwd, timeout, "create a venv")
    python = venv / "bin" / "python"
    if ok:
        install = [*python_command(python), "-m", "pip", "install", "--no-cache-dir", *hint.options,
                   str(hint.requirement)]
        ok, out = _run(install, cwd, timeout, f"run the hint {hint.text!r}")
    if ok:
        show = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
        ok, out = _run([*python_command(python), "-c", show, hint.requirement.name], cwd, timeout,
                       f"read the version of {hint.requirement.name} it installed")
    return (out.strip(), "") if ok else (None, out)


def check_hint(hint: Hint, published: str, timeout: float) -> str:
    """"ok" when running ``hint`` installs exactly the ``published`` version of its project, else what it did."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-hint-") as tmp:
        installed, why = run_hint(hint, Path(tmp), timeout)
    if installed is None:
        return why
    try:
        same = Version(installed) == Version(published)
    except InvalidVersion:
        same = False
    if same:
        return "ok"
    return (f"installed {hint.project} {installed}, not the published {published}: pip takes the newest version "
            f"on any index the hint names; pin it: {hint.project}=={published}")
