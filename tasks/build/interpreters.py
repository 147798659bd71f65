"""The interpreter of each matrix cell: found, checked, or the cell refused before any build.

A cell's Python (``"3.12"``) is looked for in this order, the first that answers as that CPython wins:

1. ``[build.interpreters]`` in kiln.toml (``"3.12" = "/opt/python3.12/bin/python3.12"``): the team's word;
2. ``python3.12`` on ``PATH``;
3. uv's discovery (``uv python find --system 3.12``; never a download: ``--no-python-downloads`` and
   ``UV_PYTHON_DOWNLOADS=never``), which knows uv-managed Pythons and the platform's registries;
4. pyenv's versions (``$PYENV_ROOT/versions/3.12.*``, the newest patch), which a pyenv shim on PATH does not
   reach unless that version is selected.

Every candidate is run (``-I``, with a deadline) and must say it is CPython of that ``major.minor``: a pyenv
shim that answers "command not found" is passed over, not trusted. A cell none of them answers for is refused
with :class:`InterpreterMissingError` before any unit builds, naming the cell, every place looked and what it
said, and how to provide one.

A candidate is a program Kiln runs, so the search is careful what it runs:

- ``PATH`` is read for its absolute entries only: an empty entry (a leading, trailing or doubled ``:``)
  means the working directory and a relative one a directory below it, where anyone who can write a file
  there could plant a ``python3.12``;
- nothing in the project tree runs unless ``[build.interpreters]`` names it (the team's word): a checkout's
  files are the package's, not the machine's;
- every probe (uv's discovery too, which runs the interpreters it finds) runs in a fresh scratch directory
  with a minimal environment (:func:`probe_env`: the absolute ``PATH``, the locale, ``HOME`` and ``TMPDIR``
  the scratch), never the step's credentials;
- what a candidate claims is held to what its name promises: ``python3.11`` answering 3.12 is passed over.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from kiln.core.errors import ToolchainMissingError
from kiln.core.fsutil import atomic_write_text
from kiln.core.installenv import resolver_env
from kiln.tasks.build.buildenv import CellInterpreter, _complete, env_key, uv_source_options
from kiln.tasks.project.config import KilnConfig, Variant

_log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 30.0
RESOLVE_TIMEOUT_S = 300.0
EXPLICIT = "kiln.toml [build.interpreters]"
MEMO = "interpreters.json"  # in the build cache: what each search found (see find_interpreter)
_LOCALE = ("LANG", "LC_ALL", "LC_CTYPE")
_FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"
_PROMISE = re.compile(r"^python(\d+)(?:\.(\d+))?$")  # python3.12 promises 3.12; python3, 3.x
_PROBE = ("import json, platform, sys; print('KILN-PY ' + json.dumps([sys.implementation.name, "
          "'%d.%d' % sys.version_info[:2], platform.python_version(), sys.executable]))")


class InterpreterMissingError(ToolchainMissingError):
    """A matrix cell's Python cannot be found on this machine (refused before any build)."""


@dataclass(frozen=True)
class Interpreter:
    minor: str  # "3.12"
    path: Path  # the executable as found (a venv's or pyenv's python, not resolved through links)
    version: str  # "3.12.1"
    found_by: str  # "kiln.toml [build.interpreters]", "PATH", "uv", "pyenv"


Runner = Callable[[Sequence[str], Mapping[str, str] | None], tuple[int, str]]


def search_path(value: str) -> list[str]:
    """The directories of a ``PATH`` value that are named absolutely; an empty entry (the working directory)
    and a relative one (a directory below it) are dropped: whoever can write there could plant a program."""
    return [os.path.normpath(entry) for entry in value.split(os.pathsep) if entry and os.path.isabs(entry)]


def on_path(name: str, value: str) -> str | None:
    """The absolute path of the first executable ``name`` in :func:`search_path` of ``value``, or None."""
    for entry in search_path(value):
        candidate = os.path.join(entry, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a probed program gets: the absolute ``PATH`` entries and the locale, nothing else.

    :func:`_run` adds ``HOME`` and ``TMPDIR``, both a fresh scratch directory: no credential, identity or
    Prefect variable, no user's home, reaches a candidate Kiln has not trusted yet."""
    env = {name: environ[name] for name in _LOCALE if name in environ}
    env["PATH"] = os.pathsep.join(search_path(environ.get("PATH", ""))) or _FALLBACK_PATH
    return env


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Run a probe in a fresh scratch directory (its working directory, ``HOME`` and ``TMPDIR``) with ``env``
    (:func:`probe_env` of the process's environment when None) and nothing more."""
    _log.debug("running %s", " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="kiln-probe-") as scratch:
        full = {**(probe_env(os.environ) if env is None else env), "HOME": scratch, "TMPDIR": scratch}
        try:
            done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=full,
                                  cwd=scratch, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            return 124, f"did not answer within {PROBE_TIMEOUT_S:g} s"
        except OSError as exc:
            return 127, str(exc)
    return done.returncode, done.stdout + done.stderr


def _promised(path: str | Path) -> str | None:
    """The version a candidate's file name promises ("3.12" for python3.12, "3" for python3), or None."""
    match = _PROMISE.match(Path(path).name)
    return None if match is None else match.group(1) + (f".{match.group(2)}" if match.group(2) else "")


def probe(path: str | Path, minor: str, run: Runner = _run,
          environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(full version, "") when ``path`` runs as CPython ``minor`` and its name promises no other; else
    ("", why not). The probe runs with :func:`probe_env` of ``environ`` (the process's when None)."""
    promised = _promised(path)
    if promised is not None and promised not in (minor, minor.partition(".")[0]):
        return "", f"{path} is named for Python {promised}, not {minor}"
    code, out = run([str(path), "-I", "-c", _PROBE], probe_env(os.environ if environ is None else environ))
    lines = [ln for ln in out.splitlines() if ln.startswith("KILN-PY ")]
    if code != 0 or not lines:
        tail = out.strip().splitlines()[-1] if out.strip() else "no output"
        return "", f"{path} did not run (exit {code}: {tail})"
    name, found, full, _ = json.loads(lines[-1].removeprefix("KILN-PY "))
    if name != "cpython" or found != minor:
        return "", f"{path} is {name} {full}, not CPython {minor}"
    return str(full), ""


def _in_tree(path: str | Path, root: Path) -> bool:
    """Whether ``path`` (as found, or what its links lead to) lies in the project tree ``root``."""
    tree = root.resolve()
    return any(Path(p).is_relative_to(tree) for p in (os.path.abspath(path), os.path.realpath(path)))


def _uv_env(environ: Mapping[str, str], root: Path) -> dict[str, str]:
    """:func:`probe_env` for uv's discovery, which runs every interpreter it finds on ``PATH``: the project
    tree's entries left out, where uv keeps its Pythons and its cache spelled out (the scratch ``HOME`` would
    hide them), and never a download."""
    home = Path(environ.get("HOME") or Path.home())
    data = Path(environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    cache = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
    pythons = environ.get("UV_PYTHON_INSTALL_DIR") or str(data / "uv" / "python")
    path = os.pathsep.join(e for e in search_path(environ.get("PATH", "")) if not _in_tree(e, root))
    return probe_env(environ) | {"PATH": path or _FALLBACK_PATH, "UV_PYTHON_DOWNLOADS": "never",
                                 "UV_PYTHON_INSTALL_DIR": pythons,
                                 "UV_CACHE_DIR": environ.get("UV_CACHE_DIR") or str(cache / "uv")}


def _uv() -> str | None:
    return on_path("uv", os.environ.get("PATH", "")) or on_path("uv", str(Path(sys.executable).parent.absolute()))


def _pyenv_candidates(minor: str, environ: Mapping[str, str]) -> list[Path]:
    root = Path(environ.get("PYENV_ROOT") or Path(environ.get("HOME", "~")).expanduser() / ".pyenv")
    versions = root / "versions"
    if not versions.is_dir():
        return []
    found = []
    for entry in versions.iterdir():
        parts = entry.name.split(".")
        if len(parts) == 3 and f"{parts[0]}.{parts[1]}" == minor and parts[2].isdigit():
            found.append((int(parts[2]), entry / "bin" / f"python{minor}"))
    return [path for _, path in sorted(found, reverse=True)]


def _memo_key(minor: str, explicit: Mapping[str, str], root: Path, env: Mapping[str, str]) -> str:
    """What the search depends on that is cheap to read: the table, PATH's answer, pyenv's versions, uv's binary."""
    uv = _uv()
    parts = [minor, json.dumps(sorted(explicit.items())), str(root), on_path(f"python{minor}", env.get("PATH", ""))
             or "", json.dumps([str(p) for p in _pyenv_candidates(minor, env)]),
             f"{uv}:{os.stat(uv).st_mtime_ns}" if uv else ""]
    return "\0".join(parts)


def _stat(path: Path) -> list[int]:
    found = os.stat(path)
    return [found.st_mtime_ns, found.st_size, found.st_ino]


def _remembered(memo: Path | None, key: str) -> Interpreter | None:
    """A found interpreter from an earlier search with the same inputs, if its executable is unchanged."""
    if memo is None:
        return None
    try:
        entry = json.loads(memo.read_text()).get(key)
        if entry is None or _stat(Path(entry["path"])) != entry["stat"]:
            return None
        return Interpreter(entry["minor"], Path(entry["path"]), entry["version"], entry["found_by"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remember(memo: Path | None, key: str, found: Interpreter) -> None:
    if memo is None:
        return
    try:
        entries = json.loads(memo.read_text()) if memo.is_file() else {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"minor": found.minor, "path": str(found.path), "version": found.version,
                    "found_by": found.found_by, "stat": _stat(found.path)}
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo, json.dumps(entries, indent=1, sort_keys=True) + "\n")
    except OSError as exc:  # a read-only cache only costs the next build its probes
        _log.info("cannot remember the interpreters in %s: %s", memo, exc)


def find_interpreter(minor: str, explicit: Mapping[str, str], root: Path, run: Runner = _run,
                     environ: Mapping[str, str] | None = None,
                     memo: Path | None = None) -> tuple[Interpreter | None, list[str]]:
    """The interpreter of CPython ``minor``, and what every place looked said (for the refusal's message).

    ``memo``: a file (in the build cache) remembering what a search with the same cheap-to-read inputs found;
    a remembered interpreter is used while its executable is unchanged, so a warm build runs no probe.
    """
    env = dict(os.environ if environ is None else environ)
    key = _memo_key(minor, explicit, root, env) if memo is not None else ""
    remembered = _remembered(memo, key)
    if remembered is not None and (remembered.found_by == EXPLICIT or not _in_tree(remembered.path, root)):
        return remembered, []
    tried: list[str] = []
    candidates: list[tuple[str, str | Path]] = []
    if minor in explicit:
        candidates.append((EXPLICIT, (root / explicit[minor]).expanduser().absolute()))
    found_on_path = on_path(f"python{minor}", env.get("PATH", ""))
    if found_on_path:
        candidates.append(("PATH", found_on_path))
    else:
        tried.append(f"PATH: no python{minor} (its absolute entries only)")
    uv = _uv()
    if uv is None:
        tried.append("uv: not installed")
    else:
        code, out = run([uv, "python", "find", "--system", "--no-python-downloads", "--no-config", minor],
                        _uv_env(env, root))
        lines = out.strip().splitlines()
        if code == 0 and lines and os.path.isabs(lines[-1].strip()):
            candidates.append(("uv", lines[-1].strip()))
        else:
            tried.append(f"uv python find {minor}: " + (lines[0].strip() if lines else f"exit {code}"))
    candidates += [("pyenv", p) for p in _pyenv_candidates(minor, env)]
    if not _pyenv_candidates(minor, env):
        tried.append(f"pyenv: no versions/{minor}.*")
    for found_by, path in ((by, os.path.abspath(p)) for by, p in candidates):  # probes run in a scratch directory
        if found_by != EXPLICIT and _in_tree(path, root):
            tried.append(f"{found_by}: {path} lies in the project tree ({root.resolve()}), so it is not run; name"
                         " it in kiln.toml [build.interpreters] to use it")
            continue
        full, why = probe(path, minor, run, env)
        if full:
            found = Interpreter(minor, Path(path), full, found_by)
            _remember(memo, key, found)
            return found, tried
        tried.append(f"{found_by}: {why}")
    return None, tried


def resolve_interpreters(cells: Sequence[tuple[str, str]], explicit: Mapping[str, str], root: Path,
                         run: Runner = _run, memo: Path | None = None) -> dict[str, Interpreter]:
    """``cells``: (cell name, Python) -> the interpreter of each; every cell without one refused at once."""
    found: dict[str, Interpreter | None] = {}
    looked: dict[str, list[str]] = {}
    minors = sorted({python for _, python in cells})
    with ThreadPoolExecutor(max_workers=max(1, len(minors))) as pool:  # each probe waits on a process
        answers = list(pool.map(lambda minor: find_interpreter(minor, explicit, root, run, memo=memo), minors))
    for minor, (interpreter, tried) in zip(minors, answers, strict=True):
        found[minor], looked[minor] = interpreter, tried
        if found[minor] is not None:
            _log.info("Python %s for the matrix: %s (%s, by %s)", minor, found[minor].path,  # type: ignore[union-attr]
                      found[minor].version, found[minor].found_by)  # type: ignore[union-attr]
    missing = [(name, python) for name, python in cells if found[python] is None]
    if missing:
        lines = [f"cell {name} (Python {python}): no CPython {python} found; looked at: "
                 + "; ".join(looked[python]) for name, python in missing]
        minors = sorted({python for _, python in missing})
        raise InterpreterMissingError(
            "the build is refused before anything builds: " + "\n  - ".join(["", *lines]) + "\nProvide "
            + " and ".join(f"Python {m}" for m in minors) + ": install it (e.g. `uv python install "
            + " ".join(minors) + "` or pyenv), put python3.X on PATH, or name it in kiln.toml [build.interpreters]"
            f" ({minors[0]!r} = \"/path/to/python{minors[0]}\"); or drop the cell from the variant's python axis"
            " (or exclude it)")
    return {name: found[python] for name, python in cells}  # type: ignore[misc]


_found: dict[tuple[str, tuple[tuple[str, str], ...], str], Interpreter] = {}


def cell_interpreters(config: KilnConfig, variants: Sequence[Variant],
                      strict: bool = True) -> dict[str, CellInterpreter]:
    """The interpreter of each matrix cell among ``variants`` that names a Python (found once per process).

    ``strict``: a cell without one refuses the build (:class:`InterpreterMissingError`); else it is left out.
    """
    cells = [(v.name, v.cell.python) for v in variants if v.cell is not None and v.cell.python]
    memo = config.path(config.build.cache_dir) / MEMO
    explicit = tuple(sorted(config.build.interpreters.items()))
    out: dict[str, CellInterpreter] = {}
    todo = []
    for name, python in cells:
        known = _found.get((python, explicit, str(config.root)))
        if known is not None:
            out[name] = CellInterpreter(known.path, known.minor, known.version)
        else:
            todo.append((name, python))
    if todo:
        try:
            found = resolve_interpreters(todo, dict(explicit), config.root, memo=memo)
        except InterpreterMissingError:
            if strict:
                raise
            found = {}
            for name, python in todo:
                one = find_interpreter(python, dict(explicit), config.root, memo=memo)[0]
                if one is not None:
                    found[name] = one
        for name, interpreter in found.items():
            _found[(interpreter.minor, explicit, str(config.root))] = interpreter
            out[name] = CellInterpreter(interpreter.path, interpreter.minor, interpreter.version)
    return out


class CellUnavailableError(ToolchainMissingError):
    """A matrix cell's torch (its build requirements) cannot be had for its Python here (refused before any build)."""


def check_cells_resolve(config: KilnConfig, variants: Sequence[Variant], envs_root: Path) -> None:
    """Refuse, before anything builds, a torch cell whose build requirements do not resolve for its Python.

    Only a cell whose build environment is not made yet is checked (a warm build runs nothing): ``uv pip
    compile`` resolves its requirements for the cell's Python from the machine's pip sources, reading metadata
    only (nothing is downloaded or installed)."""
    uv = _uv()
    interpreters = cell_interpreters(config, variants)
    todo = []
    for variant in variants:
        if variant.cell is None or not variant.cell.torch:
            continue
        base = interpreters.get(variant.name)
        reqs = sorted(str(Requirement(r)) for r in variant.build_requires)
        if _complete(envs_root / env_key(reqs, base.ident if base else None)):
            continue
        todo.append((variant.name, base.minor if base else f"{sys.version_info[0]}.{sys.version_info[1]}", reqs))
    if not todo or uv is None:
        return
    sources = uv_source_options()

    def resolve(item: tuple[str, str, list[str]]) -> str:
        name, minor, reqs = item
        with tempfile.TemporaryDirectory(prefix="kiln-cell-resolve-") as tmp:
            listing = Path(tmp) / "requirements.in"
            listing.write_text("".join(f"{r}\n" for r in reqs))
            # wheels only, scrubbed: an sdist's build hook is someone else's code and must not run here
            code, out = _run_long([uv, "pip", "compile", "--no-build", "--quiet", "--no-header", "--python-version",
                                   minor, *sources, str(listing)], resolver_env(Path(tmp)))
        if code == 0:
            return ""
        why = next((ln.strip() for ln in out.splitlines() if "cause:" in ln or "error" in ln.lower()), f"exit {code}")
        return f"cell {name} (Python {minor}): {', '.join(reqs)} cannot be had here: {why}"

    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        refused = [line for line in pool.map(resolve, todo) if line]
    if refused:
        raise CellUnavailableError(
            "the build is refused before anything builds:\n  - " + "\n  - ".join(refused) + "\nProvide each"
            " requirement for the cell's Python (a wheel in pip's find-links, or an index that has it), or drop"
            " the cell from the variant's axes (or exclude it)")


def _run_long(cmd: Sequence[str], env: Mapping[str, str]) -> tuple[int, str]:
    """A resolution that reads an index: its own deadline, longer than a probe's; ``env`` is its whole environment."""
    _log.info("running %s", " ".join(cmd))
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False, env=dict(env))
    except subprocess.TimeoutExpired:
        return 124, f"the resolution did not finish within {RESOLVE_TIMEOUT_S:g} s"
    return done.returncode, done.stdout + done.stderr
