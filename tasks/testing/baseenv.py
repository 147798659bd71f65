"""The shared base of test and bench environments: the variant's large dependencies, made once.

A suite's environment (:mod:`.envs`) must not download torch for every run,
nor see Kiln's own site-packages. Its large shared dependencies — torch,
Triton, numpy, pytest and the pydantic Kiln's bench harness reads its
configuration with — come from a base environment keyed by their exact
versions and the interpreter: :func:`kiln.tasks.build.buildenv.ensure_env`
makes it once (under an ``fcntl`` lock, in a temporary directory renamed
into place), and every suite environment of that key layers its
site-packages after its own. Where Kiln's interpreter has exactly those
distributions (and their dependencies) installed, the base is a copy of
their files (:mod:`.hostbase`: 25-35 s instead of 150-170 s for pip on a
loaded 2-core machine, ``benchmarks/bench_test_base.py``), keyed by every
distribution it holds; else pip installs them from the machine's
``pip.conf`` sources (so torch is the local CPU build). The versions are those of Kiln's interpreter
(what Kiln itself was tested with); a GPU variant's base takes the torch its
``build_requires`` pins instead.

Where: ``$KILN_TEST_ENV_CACHE`` (the tests point it at one directory per
user), else ``~/.cache/kiln/test-envs``, in ``bases/``; a cache directory another user owns
or may write is refused, naming it (:func:`~kiln.tasks.build.buildenv.owner_only_dir`).

Suites share the base, so nothing of it may be writable from one suite to the
next (a test that edits pytest in place must not reach another package's
suite): before it is published a new base is byte-compiled, made read-only
and its every file hashed into an integrity record (:func:`freeze`) that lives outside the base, in
Kiln's owner-only ``integrity/`` beside ``bases/`` (:func:`manifest_path`: a test that may write the base
still cannot rewrite the record that judges it);
every use checks it against that (:func:`changed_files`: a file whose size,
times and inode are unchanged keeps its recorded hash, as git's index does; a
write changes the ``ctime``, which no unprivileged process can set back). A
base that changed — or that has no such list — is logged, naming it and the
files, moved aside, deleted and made again. Read-only stops an accidental
in-place edit by a non-root test; the hash check is what catches the rest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sysconfig
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kiln.core.errors import InfrastructureError, KilnError
from kiln.core.fsutil import atomic_write_text, polled_lock
from kiln.core.venvs import venv_command
from kiln.tasks.build.buildenv import BuildEnvironmentError, ensure_env, owner_only_dir
from kiln.tasks.process import run_tool
from kiln.tasks.project.config_project import pinned_version
from kiln.tasks.testing.hostbase import HostDistributions, copy_into, host_distributions

log = logging.getLogger(__name__)

CACHE_ENV = "KILN_TEST_ENV_CACHE"
# The large dependencies a kernel package's suite shares, and what Kiln's harness needs inside the environment.
BASE_DISTRIBUTIONS = ("torch", "triton", "numpy", "pytest", "pydantic")
CREATE_TIMEOUT_S = 1800.0  # a cold base: torch and Triton from pip's sources
COMPILE_TIMEOUT_S = 600.0
BASES = "bases"  # frozen bases live here, apart from the unchecked ones of before
INTEGRITY = "integrity"  # beside bases/: each frozen base's record of its files, out of the base's reach
_SHOWN = 5  # changed files named in the log
HASH_THREADS = 4


@dataclass(frozen=True)
class BaseEnv:
    """A made base environment: its root, its site-packages, the pins it was made from."""

    root: Path
    site: Path
    pins: tuple[str, ...]


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kiln" / "test-envs"


def base_pins(backend: str = "cpu", build_requires: Sequence[str] = ()) -> tuple[str, ...]:
    """``name==version`` of each base distribution Kiln's interpreter has; a GPU variant's torch pin wins."""
    pins = []
    for name in BASE_DISTRIBUTIONS:
        pinned = pinned_version(build_requires, name) if backend != "cpu" else None
        try:
            version = pinned or metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        pins.append(f"{name}=={version}")
    return tuple(pins)


def site_packages(root: Path) -> Path:
    """The purelib directory of the environment at ``root`` (made by this interpreter)."""
    return Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))


def base_env(pins: Sequence[str], variant: str = "cpu") -> BaseEnv:
    """The base environment of ``pins`` (made now, or found and unchanged); its creation is logged with its time."""
    start = time.perf_counter()
    root = owner_only_dir(cache_root()) / BASES
    log.info("test base environment of %s (%s): finding or creating it under %s (a cold one takes minutes)",
             variant, ", ".join(pins), root)
    host = host_distributions(pins)  # Kiln's interpreter has them all: copied from it, else pip installs them
    requirements, fill = (host.pins, functools.partial(_copy_host, host)) if host else (tuple(pins), None)
    made = ensure_env(root, requirements, variant, CREATE_TIMEOUT_S, finish=freeze, fill=fill)
    changed = None if made.created else changed_files(made.root)
    if changed:
        _discard(made.root, changed)
        made = ensure_env(root, requirements, variant, CREATE_TIMEOUT_S, finish=freeze, fill=fill)
    log.info("test base environment %s %s in %.1f s", made.root.name[:16], "created" if made.created else "found",
             time.perf_counter() - start)
    return BaseEnv(made.root, site_packages(made.root), made.requirements)


# The (cache root, pins) of each base this process started to prepare in the background.
_preparing: set[tuple[str, tuple[str, ...]]] = set()
_preparing_lock = threading.Lock()


def prepare_bases(variants: Iterable[tuple[str, Sequence[str]]]) -> threading.Thread:
    """Start making, in a background thread, the bases of ``variants`` ((backend, build_requires) each) that are
    copied from Kiln's interpreter, so the test stage finds them made: the nightly's build runs meanwhile (on
    a first run, the cold base was the test stage's first 25-35 s). A base pip would make is left to the test
    stage (minutes of downloads for a suite that may be dispatched elsewhere or not run). Creation is under
    the base's lock, so a suite that asks meanwhile waits for it; a failure here is logged and the suite that
    needs the base makes it again, failing there with the error. A base this process has already started to
    prepare is not prepared twice (a command starts it while its server starts, its nightly again)."""
    wanted: dict[tuple[str, ...], str] = {}
    root = str(cache_root())
    with _preparing_lock:
        for backend, reqs in variants:
            pins = base_pins(backend, tuple(reqs))
            if (root, pins) not in _preparing:
                wanted.setdefault(pins, backend)
        _preparing.update((root, pins) for pins in wanted)

    def prepare() -> None:
        for pins, backend in wanted.items():
            try:
                if host_distributions(pins) is not None:  # read here: Kiln's RECORDs, off the build's path
                    base_env(pins, backend)
            except (KilnError, OSError) as exc:
                log.warning("preparing the test base of %s failed (the test stage makes it again): %s",
                            ", ".join(pins), exc)

    thread = threading.Thread(target=prepare, name="kiln-test-base", daemon=True)
    thread.start()
    return thread


def _copy_host(host: HostDistributions, tmp: Path) -> None:
    """A base at ``tmp``: an environment of Kiln's interpreter, without pip, holding copies of ``host``'s files."""
    done = run_tool(venv_command(tmp), COMPILE_TIMEOUT_S)
    if done.returncode != 0:
        raise BuildEnvironmentError(f"cannot create the test base {tmp}: python -m venv failed (exit "
                                    f"{done.returncode}): {done.stdout.strip()[-1500:]}")
    start = time.perf_counter()
    copy_into(site_packages(tmp), host)
    log.info("test base: %d files of %d distributions copied from Kiln's interpreter (%s) in %.1f s",
             len(host.files), len(host), ", ".join(host.pins), time.perf_counter() - start)


def _files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to ``root``, lstat) of every file and symbolic link under ``root``."""
    todo = [""]
    while todo:
        prefix = todo.pop()
        with os.scandir(root / prefix if prefix else root) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    todo.append(rel + os.sep)
                else:
                    yield rel, entry.stat(follow_symlinks=False)


def _content(path: Path, found: os.stat_result) -> str:
    if stat.S_ISLNK(found.st_mode):
        return "link:" + os.readlink(path)
    with open(path, "rb") as handle:
        return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


def _stamp(found: os.stat_result) -> list[int]:
    return [found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino]


def freeze(root: Path) -> None:
    """Byte-compile the base at ``root`` (so no test needs to write into it), make it read-only, hash its files."""
    python = root / "bin" / "python"
    try:
        done = subprocess.run([str(python), "-I", "-m", "compileall", "-q", str(site_packages(root))],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"byte-compiling the test base {root} took over {COMPILE_TIMEOUT_S:g}s") from exc
    if done.returncode != 0:  # a module that does not compile cannot be imported either: not the base's problem
        log.info("byte-compiling the test base %s: some files do not compile: %s", root, done.stdout.strip()[-500:])
    try:
        for here, dirs, names in os.walk(root):
            for name in [*names, *dirs]:
                path = os.path.join(here, name)
                if not os.path.islink(path):
                    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~0o222)
        found = list(_files(root))
        with ThreadPoolExecutor(HASH_THREADS) as pool:  # hashlib lets go of the GIL: 1.5 GB on every core
            contents = list(pool.map(lambda item: _content(root / item[0], item[1]), found))
        files = {rel: [content, *_stamp(st)] for (rel, st), content in zip(found, contents, strict=True)}
    except BaseException:
        _writable_dirs(root)  # so the creator can remove what it could not finish
        raise
    atomic_write_text(manifest_path(root), json.dumps(files, sort_keys=True) + "\n")


def manifest_path(root: Path) -> Path:
    """Where the integrity record of the base at ``root`` lives: outside it, named by the base directory's
    identity (device and inode, kept when the finished base is renamed into place; a base made anew, or put
    in its place by someone else, has no record and is made again)."""
    found = os.stat(root)
    return owner_only_dir(root.parent.parent / INTEGRITY) / f"{found.st_dev}-{found.st_ino}.json"


def changed_files(root: Path) -> list[str]:
    """What differs in the base at ``root`` from what :func:`freeze` recorded: changed, added, removed files."""
    try:
        recorded: dict[str, list[str | int]] = json.loads(manifest_path(root).read_text())
        found = dict(_files(root))
    except (OSError, ValueError) as exc:
        return [f"its integrity record ({exc.__class__.__name__}: {exc})"]
    changed = sorted(set(recorded) ^ set(found))
    for rel, now in found.items():
        entry = recorded.get(rel)
        if entry is not None and entry[1:] != _stamp(now) and entry[0] != _content(root / rel, now):
            changed.append(rel)
    return sorted(changed)


def _discard(root: Path, changed: Sequence[str]) -> None:
    """Move the changed base at ``root`` aside (under its creation lock) and delete it."""
    more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
    log.warning("test base environment %s changed since it was made (%s%s): discarding it and making it again",
                root, ", ".join(changed[:_SHOWN]), more)
    what = f"discarding the changed test base {root}"
    with polled_lock(root.parent / f"{root.name}.lock", time.monotonic() + CREATE_TIMEOUT_S, what,
                     BuildEnvironmentError, mode=0o644):
        if not root.exists() or not changed_files(root):  # another suite replaced it meanwhile
            return
        aside = root.parent / f".changed-{root.name[:16]}-{uuid.uuid4().hex[:8]}"
        manifest_path(root).unlink(missing_ok=True)
        os.rename(root, aside)  # no suite finds it from now on; the ones running on it already ran changed code
    _writable_dirs(aside)
    shutil.rmtree(aside)


def _writable_dirs(root: Path) -> None:
    """Make the directories under ``root`` writable by their owner again: deleting a file needs its directory's."""
    for here, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
