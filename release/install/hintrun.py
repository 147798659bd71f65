"""Run a printed install hint as a user would, and say which version it installed.

The hint a run prints (``pip install --index-url KILN --no-deps NAME==VERSION kiln-runtime==…
&& pip install --index-url KILN --extra-index-url … NAME==VERSION``, each step isolated from the
caller's pip configuration as ``env PIP_CONFIG_FILE=/dev/null pip install --isolated …``,
:func:`kiln.flows.report.hint.install_command`) is what users paste. pip merges the
candidates of every index it is given, so an unpinned name can install a
higher release from an extra index instead of what was published; only
running the hint shows which. :func:`run_hint` does so in a fresh virtual
environment, with its interpreter in isolated mode (``-I``), in an empty
working directory, with no pip configuration file, in the scrubbed
environment of :mod:`kiln.core.installenv`, wheels only, every command
under a timeout; :func:`check_hint` compares the installed version with the
published one. Given what the index holds, each step is resolved first
(``--dry-run --report``) and not run when it would take a name the index
holds from another index: the attacker's ``.pth`` never gets to run inside
the check. Each step is resolved a second time under the caller's own pip
configuration (:mod:`kiln.release.install.pipconfig`: its pip.conf, ``PIP_EXTRA_INDEX_URL``,
``PIP_FIND_LINKS``), which pip merges into any command that is not isolated
from it; a configured index or find-links that would win a held name is named.

Only the commands and options Kiln prints are accepted (``pip install`` steps
joined by ``&&``, each optionally isolated as Kiln prints it, ``env
PIP_CONFIG_FILE=/dev/null pip install --isolated``; ``--index-url``/``-i``,
``--extra-index-url``, ``--no-deps``) and one requirement per step (several
with ``--no-deps``): anything else is refused before anything runs, naming
the hint. The uv command Kiln prints is accepted as well (:mod:`kiln.release.install.hint_uv`): resolved to a lock
first, then run with uv.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError
from kiln.core.installenv import run_installer
from kiln.core.venvs import venv_command
from kiln.release.install import hint_uv
from kiln.release.install.installer import check_index_url, python_command
from kiln.release.install.pipconfig import PipConfig
from kiln.release.install.provenance import Resolution, foreign, pip_dry_run

log = logging.getLogger(__name__)

_OPTIONS = {"--index-url", "-i", "--extra-index-url"}
_FLAGS = {"--no-deps", "--isolated"}
_ASSIGNMENT = re.compile(r"(PIP_[A-Z0-9_]+)=(.*)", re.DOTALL)
NO_CONFIG = {"PIP_CONFIG_FILE": os.devnull}
_AND = "&&"
_TAIL = 1500  # characters of a failed command's output in the report


@dataclass(frozen=True)
class Step:
    """One ``pip install`` of a hint: its options (as given), its requirements, and the ``PIP_*`` variables
    it sets for itself (``env PIP_CONFIG_FILE=/dev/null pip install …``)."""

    options: tuple[str, ...]
    requirements: tuple[Requirement, ...]
    env: tuple[tuple[str, str], ...] = ()
    tool: str = "pip"  # or "uv"
    unset: tuple[str, ...] = ()  # uv's: the variables its ``env -u`` removes

    @property
    def index_url(self) -> str:
        if self.tool == "uv":
            return hint_uv.kiln_index(self.options)
        urls = [self.options[i + 1] for i, flag in enumerate(self.options) if flag in ("--index-url", "-i")]
        return urls[-1] if urls else ""

    @property
    def indexes(self) -> list[str]:
        flags = hint_uv.URL_OPTIONS if self.tool == "uv" else _OPTIONS
        return [self.options[i + 1] for i, flag in enumerate(self.options) if flag in flags]

    def argv(self) -> list[str]:
        return [*self.options, *map(str, self.requirements)]


@dataclass(frozen=True)
class Hint:
    """A parsed install hint: its ``pip install`` steps (joined by ``&&``) and the requirement it is for."""

    text: str
    steps: tuple[Step, ...]

    @property
    def requirement(self) -> Requirement:
        return self.steps[0].requirements[0]

    @property
    def options(self) -> tuple[str, ...]:
        return self.steps[0].options

    @property
    def project(self) -> str:
        return canonicalize_name(self.requirement.name)


def parse_hint(text: str) -> Hint:
    """The hint ``text`` as a shell and pip would read it; InvalidInputError naming it when it is not one
    Kiln prints: one or more ``pip install`` commands joined by ``&&``, of Kiln's options only."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise InvalidInputError(f"install hint {text!r}: {exc}") from exc
    commands: list[list[str]] = [[]]
    for arg in argv:
        if arg == _AND:
            commands.append([])
        else:
            commands[-1].append(arg)
    steps = tuple(_parse_step(text, command) for command in commands)
    names = {canonicalize_name(step.requirements[0].name) for step in steps}
    if len(names) != 1:
        raise InvalidInputError(f"install hint {text!r}: its steps install different projects first ({sorted(names)})")
    return Hint(text, steps)


def _assignments(text: str, argv: list[str]) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """The ``PIP_*`` variables a command sets for itself (``env NAME=VALUE …`` or the shell's ``NAME=VALUE …``)
    and the command that follows."""
    rest = argv[1:] if argv[:1] == ["env"] else argv
    found = []
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        match = _ASSIGNMENT.fullmatch(rest[0])
        if match is None:
            raise InvalidInputError(f"install hint {text!r}: sets {rest[0].partition('=')[0]!r}; a hint Kiln prints "
                                    "sets only PIP_* variables")
        found.append((match.group(1), match.group(2)))
        rest = rest[1:]
    return tuple(found), rest


def _parse_step(text: str, argv: list[str]) -> Step:
    if hint_uv.is_uv(argv):
        unset, uv_options, uv_requirements = hint_uv.parse_uv(text, argv)
        return _step(text, uv_options, uv_requirements, tool="uv", unset=unset)
    env, argv = _assignments(text, argv)
    if argv[:2] != ["pip", "install"]:
        raise InvalidInputError(f"install hint {text!r}: each command must start with 'pip install' "
                                "(or 'env PIP_CONFIG_FILE=/dev/null pip install', or be the uv command Kiln prints)")
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
        elif arg in _FLAGS:
            options.append(arg)
        elif arg.startswith("-"):
            raise InvalidInputError(f"install hint {text!r}: option {arg!r} is not one Kiln prints "
                                    f"({', '.join(sorted(_OPTIONS | _FLAGS))})")
        else:
            requirements.append(arg)
    return _step(text, tuple(options), requirements, env)


def _step(text: str, options: tuple[str, ...], requirements: list[str], env: tuple[tuple[str, str], ...] = (),
          tool: str = "pip", unset: tuple[str, ...] = ()) -> Step:
    if not requirements or (len(requirements) > 1 and "--no-deps" not in options):
        raise InvalidInputError(f"install hint {text!r}: names {len(requirements)} requirements, not exactly one "
                                "(several only with --no-deps: the project and what the index holds of its "
                                "dependencies)")
    try:
        return Step(options, tuple(Requirement(r) for r in requirements), env, tool, unset)
    except InvalidRequirement as exc:
        raise InvalidInputError(f"install hint {text!r}: {exc}") from exc


def _run(cmd: list[str], cwd: Path, timeout: float, what: str,
         env: Mapping[str, str] = NO_CONFIG, unset: tuple[str, ...] = ()) -> tuple[bool, str]:
    """(succeeded, stdout or what failed) of ``cmd`` in ``cwd``: scrubbed environment less ``unset``, and ``env``
    (by default no pip configuration file)."""
    try:
        done = run_installer(cmd, cwd, timeout, env, unset)
    except subprocess.TimeoutExpired:
        return False, f"{what}: timed out after {timeout:.0f} s"
    except OSError as exc:
        return False, f"{what}: cannot run {cmd[0]}: {exc}"
    if done.returncode != 0:
        return False, f"{what}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-_TAIL:]}"
    return True, done.stdout


def _resolve(python: Path, step: Step, cwd: Path, timeout: float, env: Mapping[str, str]) -> Resolution | str:
    """The wheels-only resolution of ``step`` under ``env`` and the variables the step sets itself (as the shell
    applies them after the caller's), or why there is none."""
    try:
        done = pip_dry_run(python_command(python), step.options, [str(r) for r in step.requirements], cwd, timeout,
                           {**env, **dict(step.env)})
    except subprocess.TimeoutExpired:
        return f"resolving {shlex.join(step.argv())}: timed out after {timeout:.0f} s"
    except InvalidInputError as exc:
        return f"resolving {shlex.join(step.argv())}: {exc}"
    if done.returncode != 0:
        sdists = f" (only an sdist of {', '.join(done.sdists)}: not built, wheels only)" if done.sdists else ""
        errors = " ".join(line.strip() for line in done.output.splitlines() if line.startswith("ERROR:"))
        return f"resolving {shlex.join(step.argv())} failed{sdists}: {errors[-_TAIL:]}"
    return done


def _precheck(python: Path, step: Step, held: Mapping[str, frozenset[str]], cwd: Path, timeout: float,
              index: str = "") -> str:
    """"ok" when ``step`` would take every held name from its own ``--index-url`` (by content), wheels only,
    with no pip configuration; else what it would take from where, or the sdist-only dependency it would have
    to build."""
    if step.tool == "uv":
        chosen = hint_uv.resolve(python, step.options, [str(r) for r in step.requirements], step.unset, cwd,
                                 timeout)
        return chosen if isinstance(chosen, str) else "; ".join(
            foreign(chosen, index or step.index_url, held, step.indexes)) or "ok"
    done = _resolve(python, step, cwd, timeout, NO_CONFIG)
    if isinstance(done, str):
        return done
    return "; ".join(foreign(done.chosen, index or step.index_url, held, step.indexes)) or "ok"


def _precheck_caller(python: Path, step: Step, held: Mapping[str, frozenset[str]], cwd: Path, timeout: float,
                     caller: PipConfig) -> str:
    """"ok" when, under the caller's pip configuration, ``step`` still takes every held name from its own
    ``--index-url``; else each held name a configured source would win, naming the setting and its URL."""
    done = _resolve(python, step, cwd, timeout, caller.env)
    if isinstance(done, str):
        return f"under your pip configuration, {done}"
    problems = []
    for item in done.chosen:
        files = held.get(item.name)
        if files is not None and item.sha256 not in files:
            settings = "; ".join(map(str, caller.named(item.url)))
            problems.append(f"{item.name} {item.version} would come from {item.url} (configured by {settings}), not "
                            f"from the Kiln index {step.index_url}, which holds {item.name}")
    if not problems:
        return "ok"
    return (f"under your pip configuration, {'; '.join(problems)}: pip adds a configured index or find-links to "
            f"every install not isolated from its configuration; run the command as Kiln prints it "
            f"(env PIP_CONFIG_FILE={os.devnull} pip install --isolated …)")


def _install(python: Path, step: Step) -> list[str]:
    """The install ``step`` runs into the venv of ``python``: wheels only, no cache of the user's."""
    if step.tool == "uv":
        return hint_uv.install_command(python, step.options, [str(r) for r in step.requirements])
    return [*python_command(python), "-m", "pip", "install", "--no-cache-dir", "--only-binary", ":all:",
            *step.argv()]


def run_hint(hint: Hint, workdir: Path, timeout: float, held: Mapping[str, frozenset[str]] | None = None,
             caller: PipConfig | None = None, index: str = "") -> tuple[str | None, str]:
    """Run ``hint`` in a fresh venv under ``workdir``: (the version of its project it installed, or None; why not).

    Wheels only. With ``held`` (each name the index holds -> the SHA-256 of its files there), every step is
    first resolved without installing, with no pip configuration and, given ``caller``'s sources, under the
    caller's pip configuration too; a step that would take a held name from another index is not run.
    ``index``: the Kiln index that holds them, as a refusal names it (default: the step's own).
    """
    venv, cwd = workdir / "venv", workdir / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    ok, out = _run(venv_command(venv, pip=True), cwd, timeout, "create a venv")
    python = venv / "bin" / "python"
    for step in hint.steps if ok else ():
        if held is not None:
            out = _precheck(python, step, held, cwd, timeout, index)
            if out == "ok" and caller is not None and caller.sources and step.tool == "pip":  # uv reads no pip.conf
                out = _precheck_caller(python, step, held, cwd, timeout, caller)
            ok = out == "ok"
        if ok:
            ok, out = _run(_install(python, step), cwd, timeout, f"run the hint {hint.text!r}",
                           {**NO_CONFIG, **dict(step.env)}, step.unset)
        if not ok:
            break
    if ok:
        show = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
        ok, out = _run([*python_command(python), "-c", show, hint.requirement.name], cwd, timeout,
                       f"read the version of {hint.requirement.name} it installed")
    return (out.strip(), "") if ok else (None, out)


def check_hint(hint: Hint, published: str, timeout: float, held: Mapping[str, frozenset[str]] | None = None,
               caller: PipConfig | None = None, index: str = "") -> str:
    """"ok" when running ``hint`` installs exactly the ``published`` version of its project, else what it did."""
    with tempfile.TemporaryDirectory(prefix="kiln-verify-hint-") as tmp:
        installed, why = run_hint(hint, Path(tmp), timeout, held, caller, index)
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
