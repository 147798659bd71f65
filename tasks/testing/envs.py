"""A fresh, isolated environment per suite (and per bench): the suite runs against what a user installs.

:func:`make_env` makes a ``uv venv`` that holds exactly the variant's wheel,
the dependencies its METADATA declares (``Requires-Dist``, resolved by uv
from the run's wheels — the wheel itself and the ``kiln-runtime`` wheel the
run publishes beside it — and the configured indexes, PyPI by default),
pytest, and the suite's ``requires`` (installed, not merely checked). None of
Kiln's own site-packages is visible.

Why this shape (the closest real thing to "a fresh venv per suite" that does
not download torch for every suite):

- the large shared dependencies (torch, Triton, numpy, pytest, and pydantic
  for Kiln's bench harness) come from a base environment per variant, keyed
  by their exact versions and the interpreter, made once by pip from the
  machine's sources (:mod:`.baseenv`), and layered *after* the environment's
  own site-packages (:mod:`.layers`); uv sees them as installed and keeps
  their versions as constraints, so it installs only the rest (from its
  cache when warm, as copies: ``--link-mode copy``, since uv's default
  hard links would make a test's in-place edit of an installed file an edit
  of uv's cache and of every other environment linked to it);
- because the base holds more than the wheel declares (pytest's own
  ``packaging``, numpy for a wheel that does not ask for it), an import guard
  (:mod:`.importguard`) refuses, for imports made by the wheel's modules,
  every top-level module outside the closure of the wheel's declared
  requirements, with a ``ModuleNotFoundError`` that names it; test files
  under the project root are held to the closure of the wheel, pytest and
  the suite's ``requires``;
- Kiln's harness that runs inside the environment (the test worker, the
  bench server) imports Kiln from a directory of the environment holding a
  copy of only ``kiln``'s own packages (:func:`.layers.expose_harness`).

So a suite's environment shares nothing writable with another's: its own
files are copies, the base is read-only and checked by hash before each use
(:mod:`.baseenv`).

:func:`make_build_env` is different: a project's own build backend
(``[build] backend = "pep517"``) still sees Kiln's packages after its own.
"""

from __future__ import annotations

import email.message
import email.parser
import functools
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import InfrastructureError, PermanentError
from kiln.core.installenv import scrubbed_env, user_cache
from kiln.core.sandbox import installer_command, wheels_only_hint
from kiln.core.venvs import make_build_env as make_build_env  # a pep517 build's environment, kept here by name
from kiln.core.venvs import run as _run
from kiln.core.venvs import site_packages as _site_packages
from kiln.core.venvs import unmet_requirements as unmet_requirements  # kept here by name
from kiln.core.venvs import uv_command, venv_command
from kiln.core.wheels import core_metadata
from kiln.tasks.build.buildenv import pip_sources
from kiln.tasks.testing import layers
from kiln.tasks.testing.baseenv import BaseEnv, base_env, base_pins
from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0
INSTALL_TIMEOUT_S = 900.0  # resolving and downloading a wheel's dependencies
DEFAULT_INDEXES = ("https://pypi.org/simple",)


class DependencyResolutionError(PermanentError):
    """A wheel's declared dependencies (or a suite's ``requires``) cannot be installed into its environment."""


@dataclass(frozen=True)
class TestEnv:
    """A prepared environment: its interpreter and what was installed into it."""

    __test__ = False  # not a pytest test class

    root: Path
    python: Path
    installed: tuple[str, ...]


@functools.cache
def _installer_home() -> Path:
    """A private, empty ``HOME`` for this process's installers (no ``~/.aws``, ``~/.netrc`` or user config)."""
    return Path(tempfile.mkdtemp(prefix="kiln-installer-home-"))


def installer_env() -> dict[str, str]:
    """The environment uv installs a suite's dependencies with: :func:`~kiln.core.installenv.scrubbed_env`.

    Resolving what a suite declares may build an sdist from an extra index, whose PEP 517 hook is
    someone else's code: it must see no cloud credentials, no Prefect API key and no user's home. uv's
    cache stays the user's, named explicitly (``HOME`` is not), so a warm install stays warm.
    """
    return scrubbed_env(_installer_home(), extra={"UV_CACHE_DIR": user_cache("uv", "UV_CACHE_DIR")})


def wheel_requirements(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel (its METADATA read bounded, by :func:`read_member`)."""
    return _wheel_metadata(wheel).get_all("Requires-Dist") or []


def wheel_distribution(wheel: Path) -> str:
    """The distribution name a wheel's METADATA states."""
    return str(_wheel_metadata(wheel).get("Name", ""))


def _wheel_metadata(wheel: Path) -> email.message.Message:
    return email.parser.BytesHeaderParser().parsebytes(core_metadata(wheel.name, wheel))


_MADE: dict[Path, TestEnv] = {}  # environments made in this process, by what they are for (a run's suite)
_MAKING: dict[Path, threading.Lock] = {}
_MAKING_GUARD = threading.Lock()


def made_once(key: Path, make: Callable[[], TestEnv]) -> TestEnv:
    """The environment for ``key``, made by ``make`` the first time it is asked for in this process; a caller asking
    while it is made waits for it. The shards of a suite run here share one: the same wheels and requirements, as
    the workers of one unsharded suite share theirs (each test still runs in its own process and work folder).
    ``make`` names the folder: shards run by other processes each make their own there, never the same one."""
    with _MAKING_GUARD:
        lock = _MAKING.setdefault(key, threading.Lock())
    with lock:
        if key not in _MADE:
            _MADE[key] = make()
        else:
            log.info("test environment %s: made once in this process, shared", _MADE[key].root)
        return _MADE[key]


def make_env(root: Path, wheels: Sequence[Path], requirements: Sequence[str] = (), *,
             indexes: Sequence[str] = DEFAULT_INDEXES, tests_root: Path | None = None, test_paths: Sequence[str] = (),
             backend: str = "cpu", build_requires: Sequence[str] = (), python: Path | None = None,
             shared_base: bool = True, base: BaseEnv | None = None) -> TestEnv:
    """A fresh, isolated environment at ``root``: ``wheels``, what they declare, ``requirements``, pytest.

    The base of ``backend``/``build_requires`` is layered after the environment's own site-packages, Kiln's
    harness is exposed, and the import guard refuses, for the first wheel's modules (and for the test files
    under ``test_paths`` of ``tests_root``, all of it when none), what they do not declare. Errors name the
    wheel and the requirements that failed.

    ``python``: a matrix cell's interpreter (default: this one). ``shared_base`` false: no base layer (a wheel
    that requires neither torch nor Triton): uv installs pytest and the rest into the environment.
    ``base``: a made environment to stand on instead (another torch's, for a stable-ABI wheel's run under each
    torch it claims): only what it holds is fixed, uv installs pytest and the rest.
    """
    own_base = base is None
    if base is None and shared_base:
        base = base_env(base_pins(backend, build_requires), backend)
    if root.exists():
        shutil.rmtree(root)
    _run(venv_command(root, python, uv=True), f"creating {root}")
    python = root / "bin" / "python"
    site = _site_packages(python)
    if base is not None:
        layers.layer_base(site, base.site)
    layers.expose_harness(site, root / "kiln-harness")
    names = ", ".join(w.name for w in wheels)
    _install(root, python, wheels, [*requirements, *(() if base and own_base else ("pytest",))], indexes,
             base.site if base else None, names)
    if wheels:
        layers.install_guard(site, python, wheels[0].name, wheel_distribution(wheels[0]),
                             ["pytest", *requirements], tests_root, test_paths,
                             installed=(root, base.root) if base else (root,))
    log.info("test environment %s: %s, on %s", root, names, f"base {base.root.name[:16]}" if base else "no base")
    return TestEnv(root, python, tuple(w.name for w in wheels))


def _install(root: Path, python: Path, wheels: Sequence[Path], requirements: Sequence[str], indexes: Sequence[str],
             base_site: Path | None, names: str) -> None:
    """uv installs the wheels, what they declare and ``requirements``; the base's versions are constraints."""
    runtime = build_runtime_wheel(root / "links")  # Kiln's harness imports kiln.runtime; the run publishes it too
    constraints = root / "base-constraints.txt"
    pins = layers.installed_pins(base_site) if base_site is not None else []
    constraints.write_text("".join(f"{pin}\n" for pin in pins))
    links, pip_indexes = pip_sources()
    index_options = [option for url in (*indexes, *pip_indexes) for option in ("--extra-index-url", url)]
    index_options += [option for link in links for option in ("--find-links", link)]
    also = f" with {', '.join(requirements)}" if requirements else ""
    what = f"installing {names} and its declared dependencies{also}"
    log.info("%s into %s (uv, from the run's wheels, %s)", what, root, ", ".join(indexes) or "no index")
    try:
        env = installer_env()
        cmd = [*uv_command(), "pip", "install", "--quiet", "--link-mode", "copy", "--python", str(python),
               "--constraint", str(constraints),
               "--find-links", str(runtime.parent), *index_options, *map(str, wheels), str(runtime), *requirements]
        # installer_command grants what the command names (the constraints, the runtime's folder, every local
        # index and find-links source, the wheels); beside it, the wheels' folders and the base it layers on
        reads = [*(w.parent for w in wheels), *((base_site,) if base_site else ())]
        guest, guest_env = installer_command(cmd, python, env, read=reads, write=[root])
        _run(guest, what, timeout=INSTALL_TIMEOUT_S, env=guest_env)
    except InfrastructureError as exc:
        raise DependencyResolutionError(
            f"the test environment for {names} cannot be made: {exc}. Requires-Dist of {names}: "
            f"{[r for w in wheels for r in wheel_requirements(w)] or 'none'}; suite requires: {list(requirements)};"
            f" indexes: {list(indexes)}; fixed by the shared base: {', '.join(pins) or 'nothing (no base)'}"
            f"{wheels_only_hint(str(exc))}") from exc
