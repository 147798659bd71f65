"""Per-variant build environments: a variant's ``build_requires`` (e.g. a CUDA build of torch), made once.

A variant of ``kiln.toml`` may name what its build needs (``build_requires =
["torch==2.14.1"]``); every native unit of the variant (its ``pep517`` project
build, its torch-extension nvcc units) then runs with that environment instead
of Kiln's own. A variant without ``build_requires`` keeps Kiln's environment.

Layout: ``<build cache>/envs/<key>/``, a virtual environment made with
``python -m venv`` and filled by pip from the machine's configured index
(``pip.conf``: its find-links, indexes and constraints). ``key`` is the sha256
of the sorted requirements and the interpreter's version, so two variants
that need the same things share one environment, on any worker sharing the
cache. Creation is atomic and happens once:

- an ``fcntl`` lock on ``envs/<key>.lock`` makes one builder create it while
  any other waits (polling, to its deadline, naming what it waits for);
- the environment is made in ``envs/.tmp-<key>-…`` beside it, its scripts'
  shebangs pointed at the final path, its ``kiln-env.json`` written last, then
  one ``rename`` publishes it: a reader sees a whole environment or none;
- a failed creation removes the temporary directory and raises
  :class:`BuildEnvironmentError` naming the variant, the requirements and the
  tail of pip's output.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from packaging.requirements import Requirement

from kiln.core import venvs
from kiln.core.errors import CompileError, KilnError, PermanentError, UnsafePathError
from kiln.core.fsutil import digest, polled_lock
from kiln.core.installenv import scrubbed_env, user_cache
from kiln.core.sandbox import installer_command, local_sources, wheels_only_hint
from kiln.tasks.build.guest_install import offline_wheels, pip_env
from kiln.tasks.process import run_tool

_log = logging.getLogger(__name__)
T = TypeVar("T")
ENV_FORMAT = "kiln-buildenv-1"
# Installed with every environment: a project build with --no-build-isolation needs a current setuptools and wheel.
SEED = ("pip", "setuptools", "wheel")
# A matrix cell's environment on another interpreter also gets packaging (Kiln's requirement check runs there).
CELL_SEED = (*SEED, "packaging")
MARKER = "kiln-env.json"
_TAIL_CHARS = 3000
_POLL_S = 0.5
_PROBE_TIMEOUT_S = 180.0
_PROBE = ("import json, sys\ntry:\n import torch\nexcept ImportError:\n print('KILN-PROBE ' + json.dumps(None)); "
          "sys.exit(0)\nprint('KILN-PROBE ' + json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda,"
          " 'hip': getattr(torch.version, 'hip', None)}))\n")


class BuildEnvironmentError(PermanentError):
    """A variant's build environment could not be made, or cannot build the variant (a CPU torch for CUDA)."""


def interpreter_id() -> str:
    """What an environment made by this interpreter depends on: implementation, version, machine."""
    return f"{sys.implementation.name}-{platform.python_version()}-{platform.machine()}"


def env_key(requirements: Sequence[str], interpreter: str | None = None) -> str:
    """sha256 of the sorted requirements (spelled canonically) and the interpreter (this one by default; a
    matrix cell's ``cpython-3.12.1-x86_64`` with its own seed)."""
    if interpreter is None:
        return digest(ENV_FORMAT, interpreter_id(), *SEED, *sorted(str(Requirement(r)) for r in requirements))
    return digest(ENV_FORMAT, interpreter, *CELL_SEED, *sorted(str(Requirement(r)) for r in requirements))


@dataclass(frozen=True)
class BuildEnvironment:
    """One made environment: its root, what it was made from, and whether this call made it."""

    root: Path
    requirements: tuple[str, ...]
    created: bool = False
    minor: str = ""  # a matrix cell's Python ("3.10"); "": Kiln's own interpreter

    @property
    def safe_path(self) -> str:
        """The flag that keeps the working directory off ``sys.path``: ``-P`` (3.11+), else ``-I``."""
        return "-I" if self.minor and int(self.minor.split(".")[1]) < 11 else "-P"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"


def _complete(root: Path) -> bool:
    try:
        return bool(json.loads((root / MARKER).read_text()).get("format") == ENV_FORMAT)
    except (OSError, ValueError, AttributeError):
        return False


def _relocate(tmp: Path, final: Path) -> None:
    """Point the scripts pip wrote (``#!<tmp>/bin/python``) and the activate scripts at ``final``."""
    old, new = str(tmp).encode(), str(final).encode()
    for script in (tmp / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        data = script.read_bytes()
        head = data[:4096]
        if old in head and (data.startswith(b"#!") or script.name.startswith("activate")):
            script.write_bytes(data.replace(old, new))


def _tail(text: str) -> str:
    return text[-_TAIL_CHARS:].strip()


def uv_env() -> dict[str, str]:
    """uv's environment when it fills a matrix cell's build environment: scrubbed, as
    :func:`~kiln.tasks.build.guest_install.pip_env`, with
    uv's own cache kept (``HOME`` is a fresh empty directory, removed at exit with the process's temporaries)."""
    return scrubbed_env(Path(tempfile.mkdtemp(prefix="kiln-uv-home-")),
                        extra={"UV_CACHE_DIR": user_cache("uv", "UV_CACHE_DIR")})


def _make(tmp: Path, final: Path, requirements: Sequence[str], variant: str, timeout_s: float,
          base: CellInterpreter | None = None, fill: Callable[[Path], None] | None = None) -> None:
    what = f"the build environment of variant {variant} ({', '.join(requirements) or base and base.ident})"
    uv = (shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))) if base else None
    if fill is not None:
        fill(tmp)
    elif base is not None and uv is not None:
        _fill_with_uv(uv, tmp, base, requirements, timeout_s, what)
    else:
        _fill_with_pip(tmp, base, requirements, timeout_s, what)
    _relocate(tmp, final)
    info = {"format": ENV_FORMAT, "requirements": list(requirements),
            "interpreter": base.ident if base else interpreter_id(),
            "created": time.time(), "by": f"{platform.node()}:{os.getpid()}"}
    (tmp / MARKER).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")


def _fill_with_pip(tmp: Path, base: CellInterpreter | None, requirements: Sequence[str], timeout_s: float,
                   what: str) -> None:
    made = run_tool(venvs.venv_command(tmp, base.path if base else None, pip=True), min(timeout_s, 600))
    if made.returncode != 0:
        raise BuildEnvironmentError(f"cannot create {what}: python -m venv failed (exit {made.returncode}):\n"
                                    f"{_tail(made.stdout)}")
    python = tmp / "bin" / "python"
    # -I: the caller's PYTHONPATH and cwd never leak in; pip still reads the machine's pip.conf (its index).
    with tempfile.TemporaryDirectory(prefix="kiln-pip-home-") as home:
        env = pip_env(Path(home))
        links, indexes = pip_sources()
        try:
            given = offline_wheels(requirements, python, Path(home) / "local-wheels", timeout_s)  # no network
        except CompileError as exc:
            raise BuildEnvironmentError(f"cannot create {what}: {exc}") from exc
        cmd = [str(python), "-I", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--upgrade", *(CELL_SEED if base else SEED), *given]
        guest, guest_env = installer_command(cmd, python, env, read=local_sources([*links, *indexes]), write=[tmp])
        done = run_tool(guest, timeout_s, env=guest_env)
    if done.returncode != 0:
        raise BuildEnvironmentError(
            f"cannot create {what}: pip could not install {list(requirements)} (exit {done.returncode}); check"
            f" the requirement and the index pip is configured with{wheels_only_hint(done.stdout)}. pip's output"
            f" ends:\n{_tail(done.stdout)}")


@functools.lru_cache(maxsize=1)
def pip_sources() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(find-links, index URLs) of the machine's pip configuration: where the base's torch came from.

    uv does not read ``pip.conf``; given these, it resolves the base's packages (a local CPU build of torch)
    from the same sources pip installed them from, and installs nothing of them (they are installed).
    """
    try:
        done = run_tool([sys.executable, "-I", "-m", "pip", "config", "list"], _PROBE_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildEnvironmentError(f"pip config list failed (exit {done.returncode}): {_tail(done.stdout)}")
        out = done.stdout
    except KilnError as exc:  # no pip beside Kiln: uv's own sources only
        _log.warning("test environments resolve without pip's configured sources: %s", exc)
        return (), ()
    links: list[str] = []
    indexes: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        values = value.strip().strip("'\"").split()
        if key.endswith(".find-links"):
            links += [v for v in values if v not in links]
        elif key.endswith((".index-url", ".extra-index-url")):
            indexes += [v for v in values if v not in indexes]
    return tuple(links), tuple(indexes)


def uv_source_options() -> list[str]:
    """The machine's pip sources as uv's options: pip.conf's and ``PIP_*``'s find-links, indexes, constraints."""
    links, indexes = pip_sources()
    links += tuple(os.environ.get("PIP_FIND_LINKS", "").split())
    indexes += tuple(os.environ.get("PIP_EXTRA_INDEX_URL", "").split())
    options = [o for link in dict.fromkeys(links) for o in ("--find-links", link)]
    options += [o for url in dict.fromkeys(indexes) for o in ("--extra-index-url", url)]
    options += [o for c in os.environ.get("PIP_CONSTRAINT", "").split() for o in ("--constraint", c)]
    if os.environ.get("PIP_INDEX_URL"):
        options += ["--index-url", os.environ["PIP_INDEX_URL"]]
    return options


def _fill_with_uv(uv: str, tmp: Path, base: CellInterpreter, requirements: Sequence[str], timeout_s: float,
                  what: str) -> None:
    """A matrix cell's environment, made by uv on the cell's interpreter from the machine's pip sources (its
    pip.conf and ``PIP_*`` find-links, indexes and constraints): ``python -m venv`` and pip took 25 s a cell
    here (ensurepip, then pip upgrading itself), uv about 2 s. Copies, never links into uv's cache."""
    made = run_tool(venvs.venv_command(tmp, base.path, uv=True), min(timeout_s, 600), env=uv_env())
    if made.returncode != 0:
        raise BuildEnvironmentError(f"cannot create {what}: uv venv failed (exit {made.returncode}):\n"
                                    f"{_tail(made.stdout)}")
    env, options = uv_env(), uv_source_options()
    cmd = [uv, "pip", "install", "--quiet", "--link-mode", "copy", "--python", str(tmp / "bin" / "python"),
           *options, *CELL_SEED, *requirements]
    guest, guest_env = installer_command(cmd, tmp / "bin" / "python", env, write=[tmp])  # reads what cmd names
    done = run_tool(guest, timeout_s, env=guest_env)
    if done.returncode != 0:
        raise BuildEnvironmentError(
            f"cannot create {what}: uv could not install {[*CELL_SEED, *requirements]} (exit {done.returncode});"
            f" check the requirement and the indexes pip is configured with{wheels_only_hint(done.stdout)}. uv's"
            f" output ends:\n{_tail(done.stdout)}")


def owner_only_dir(path: Path) -> Path:
    """``path``, made owner-only if missing; refused when another user owns it or may write it.

    An environment cache whose entries another user can plant or edit would run their code as whoever uses it.
    """
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = path.stat()
    if found.st_uid != os.geteuid() or found.st_mode & 0o022:
        owner = "another user" if found.st_uid != os.geteuid() else "its group or every user can write it"
        raise UnsafePathError(
            f"environment cache {path} is not owner-only ({owner}: mode {found.st_mode & 0o7777:04o}, uid "
            f"{found.st_uid}): another user could plant or edit the environments run from it; use a directory "
            f"only you own and write (chmod 700 {path}), or another one")
    return path


@dataclass(frozen=True)
class CellInterpreter:
    """A matrix cell's interpreter for its build environment: its path, ``major.minor`` and full version."""

    path: Path
    minor: str
    version: str

    @property
    def ident(self) -> str:
        return f"cpython-{self.version}-{platform.machine()}"


def ensure_env(envs_root: Path, requirements: Sequence[str], variant: str, timeout_s: float,
               finish: Callable[[Path], None] | None = None,
               base: CellInterpreter | None = None, fill: Callable[[Path], None] | None = None) -> BuildEnvironment:
    """The environment of ``requirements`` under ``envs_root``, made now unless another builder made it first.

    ``finish`` is called on a new environment's directory before it is published (renamed into place).
    ``base``: a matrix cell's interpreter (default: this one), part of the key.
    ``fill``: makes the environment at the directory it is given instead of pip (or uv) installing
    ``requirements``, which must then say what it holds (the test base copied from Kiln's interpreter).
    """
    owner_only_dir(envs_root)
    reqs = tuple(sorted(str(Requirement(r)) for r in requirements))
    key = env_key(reqs, base.ident if base else None)
    final = envs_root / key
    minor = base.minor if base else ""
    if _complete(final):
        return BuildEnvironment(final, reqs, minor=minor)
    what = f"build environment {key[:16]} of variant {variant}"
    with polled_lock(envs_root / f"{key}.lock", time.monotonic() + timeout_s, what, BuildEnvironmentError,
                     mode=0o644):
        if _complete(final):
            return BuildEnvironment(final, reqs, minor=minor)
        if final.exists():  # not ours to trust: no marker (a crash before rename cannot leave one here)
            shutil.rmtree(final)
        tmp = envs_root / f".tmp-{key[:16]}-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        _log.info("creating the %s: %s", what, ", ".join(reqs))
        try:
            _make(tmp, final, reqs, variant, timeout_s, base, fill)
            if finish is not None:
                finish(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log.info("created the %s in %.1f s", what, time.perf_counter() - start)
        return BuildEnvironment(final, reqs, created=True, minor=minor)


@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda: str | None
    hip: str | None


def probe_torch(python: Path, timeout_s: float = _PROBE_TIMEOUT_S) -> TorchInfo | None:
    """The torch installed in ``python``'s environment (``python -I``), or None when it has none."""
    done = run_tool([str(python), "-I", "-c", _PROBE], timeout_s)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("KILN-PROBE ")]
    if done.returncode != 0 or not lines:
        raise BuildEnvironmentError(f"cannot import torch in {python} (exit {done.returncode}):\n"
                                    f"{_tail(done.stdout)}")
    found = json.loads(lines[-1].removeprefix("KILN-PROBE "))
    return None if found is None else TorchInfo(str(found["version"]), found["cuda"], found["hip"])


def check_torch_backend(variant: str, backend: str, torch: TorchInfo | None) -> None:
    """Refuse a CUDA variant whose build environment's torch has no CUDA (it cannot build a CUDA extension)."""
    if backend == "cuda" and torch is not None and torch.cuda is None:
        raise BuildEnvironmentError(
            f"variant {variant} is a CUDA variant, but the torch of its build environment ({torch.version}) is a"
            f" build without CUDA (torch.version.cuda is None), so it cannot build CUDA extensions; add"
            f' build_requires = ["torch==2.14.1"] (a CUDA build of torch) to variant {variant} in kiln.toml')


class VariantEnvironments:
    """The build environments of one build's variants: each made (or found) once, checked once, on first use.

    ``variants``: name -> (backend, build_requires). A variant with no requirements has no environment of its
    own (:meth:`for_variant` returns None: Kiln's environment). Thread-safe: units of a variant run in threads.
    """

    def __init__(self, envs_root: Path, variants: Mapping[str, tuple[str, tuple[str, ...]]], timeout_s: float,
                 interpreters: Mapping[str, CellInterpreter] | None = None) -> None:
        self.envs_root = envs_root
        self.variants = dict(variants)
        self.interpreters = dict(interpreters or {})  # a matrix cell's name -> its Python's interpreter
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._done: dict[str, BuildEnvironment | None | BaseException] = {}
        self._torch: dict[str, TorchInfo | None] = {}
        self._settings: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}

    def for_variant(self, variant: str) -> BuildEnvironment | None:
        """The variant's environment, made and preflighted; the first failure is raised again for every unit."""
        with self._lock:  # one lock per variant: a variant's creation (minutes) never holds up another's units
            mine = self._locks.setdefault(variant, threading.Lock())
        with mine:
            if variant not in self._done:
                try:
                    self._done[variant] = self._prepare(variant)
                except BuildEnvironmentError as exc:
                    self._done[variant] = exc
            outcome = self._done[variant]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def torch(self, variant: str) -> TorchInfo | None:
        """The torch of the variant's own environment (None: no environment of its own, or no torch in it)."""
        self.for_variant(variant)
        return self._torch.get(variant)

    def _prepare(self, variant: str) -> BuildEnvironment | None:
        backend, reqs = self.variants[variant]
        base = self.interpreters.get(variant)
        if not reqs and base is None:
            return None
        made = ensure_env(self.envs_root, reqs, variant, self.timeout_s, base=base)
        torch = probe_torch(made.python)
        check_torch_backend(variant, backend, torch)  # the preflight: before any unit of the variant builds
        self._torch[variant] = torch
        return made

    def settings(self, variant: str, make: Callable[[BuildEnvironment], T]) -> T:
        """``make(env)`` for the variant's environment, once per variant (e.g. its torch's nvcc settings)."""
        made = self.for_variant(variant)
        if made is None:
            raise BuildEnvironmentError(f"variant {variant} has no build environment of its own")
        with self._locks[variant]:
            if variant not in self._settings:
                self._settings[variant] = make(made)
            return self._settings[variant]  # type: ignore[no-any-return]


PARENT_SITE = "parent-site-packages"  # in an overlay environment: its link to the shared environment's packages


def overlay_env(root: Path, parent: BuildEnvironment, timeout_s: float = 300) -> Path:
    """A fresh, throwaway environment at ``root`` that sees ``parent``'s packages after its own; its python.

    A project build installs what it lacks into the overlay, so the shared environment is never changed.
    """
    made = run_tool(venvs.venv_command(root, parent.python), timeout_s)
    if made.returncode != 0:
        raise BuildEnvironmentError(f"cannot create a build environment at {root} on {parent.root}:\n"
                                    f"{_tail(made.stdout)}")
    python = root / "bin" / "python"
    # The parent's site-packages come after the overlay's own (core/venvs.py: one layering rule), named through a
    # link inside the overlay: a compile's include paths into them (torch's headers) then lie in the unit's folder,
    # the compile cache's base directory, so a worker or clone whose environments live elsewhere hits it too.
    parent_site = root / PARENT_SITE
    parent_site.symlink_to(venvs.site_packages(parent.python), target_is_directory=True)
    venvs.layer(venvs.site_packages(python), "zz_kiln_build_env", parent_site)
    return python

