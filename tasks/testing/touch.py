"""What a test touched, as stable keys, and the fingerprints that say whether those inputs changed.

The test worker (:mod:`kiln.tasks.testing.pytest_server`) builds a :class:`Recorder` once, after collection,
and installs it in each test process just before that process's first test: a PEP 578 audit hook that only
appends the ``open``, ``import`` and ``ctypes.dlopen`` events to a list (a set lookup, no I/O, no line
tracing). When a test ends, :meth:`Recorder.finish` turns what it saw, the process's own map of loaded
libraries (``/proc/self/maps``) and every module in ``sys.modules`` into keys:

- ``wheel:<archive path>`` — a member of the installed wheel under test (found through its RECORD): the
  modules imported (those the fork server had already imported at collection count for every test: a
  conservative over-approximation), the shared libraries mapped or ``dlopen``\\ ed, the data files opened.
  Members under ``<name>-<version>.dist-info/`` are ``wheel:{dist-info}/<file>``, so the version stamp of a
  nightly does not change the key. A module of the wheel whose import was tried and that does not exist
  yields the keys of the files that would provide it (``wheel:pkg/mod.py``, ``wheel:pkg/mod/__init__.py``):
  their later appearance changes the test's inputs.
- ``test:<path relative to the project root>`` — the test's own file and every ``conftest.py`` from its
  folder up to the root (whether it exists or not: a conftest added later is a change), pytest's
  configuration file, the modules under the root the test process holds other than the suite's other test
  files and conftests, and the files under the root the test opened for reading.

**An empty record means "no record".** When recording is impossible or fails (no tested distribution known,
an error while turning events into keys, a test process that did not finish) the result's ``touched`` is
``()``, and whoever selects tests by their inputs must run such a test. A record is never partial: a failure
anywhere drops it whole, and never fails the test.

The tested distribution reaches the worker as :data:`TESTED_ENV` in its environment; without it, the import
guard's configuration of the environment (which names the wheel under test) is read.

:func:`fingerprint` hashes keys against a wheel file and a project root, :func:`environment_lock` the rest of a
test environment: together with the keys, what decides whether a recorded test's inputs are unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kiln.core.errors import InfrastructureError, InvalidInputError, MemberTooLargeError

logger = logging.getLogger(__name__)

TESTED_ENV = "KILN_TESTED_DISTRIBUTION"
WHEEL, TEST = "wheel:", "test:"
DIST_INFO = "{dist-info}"
ABSENT = "absent"
EVENTS = frozenset({"open", "import", "ctypes.dlopen"})
# Written by the installer, not the wheel: never a key (RECORD's bytes change with every version stamp).
INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})
GUARD_MODULE, GUARD_CONFIG = "_kiln_import_guard", "_kiln_import_guard.json"
LOCK_TIMEOUT_S = 60.0
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHUNK = 1 << 20


def tested_distribution(environ: Mapping[str, str] = os.environ) -> str:
    """The name of the distribution under test in this interpreter, or "" when it cannot be known."""
    name = environ.get(TESTED_ENV, "").strip()
    if name:
        return name
    guard = sys.modules.get(GUARD_MODULE)
    file = getattr(guard, "__file__", None)
    if not isinstance(file, str):
        return ""
    try:
        wheel = json.loads((Path(file).parent / GUARD_CONFIG).read_text())["wheel"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return str(wheel).split("-", 1)[0] if isinstance(wheel, str) else ""


def wheel_key(record_path: str) -> str | None:
    """The key of an installed file by its RECORD path; None for what the wheel does not hold."""
    top, _, rest = record_path.partition("/")
    if record_path.startswith("../") or "/__pycache__/" in f"/{record_path}":
        return None  # scripts and data outside the package tree; bytecode (its source is the key)
    if top.endswith(".dist-info"):
        return None if rest in INSTALLER_FILES else f"{WHEEL}{DIST_INFO}/{rest}"
    return f"{WHEEL}{record_path}"


def installed_members(name: str) -> dict[str, str]:
    """{absolute path (as found and resolved): key} of the installed distribution ``name``; {} if unknown."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return {}
    members: dict[str, str] = {}
    for file in dist.files or ():
        key = wheel_key(file.as_posix())
        if key is not None:
            path = os.path.normpath(os.path.abspath(str(dist.locate_file(file))))
            members[path] = key
            members.setdefault(os.path.realpath(path), key)
    return members


def _source_of(path: str) -> str:
    """A bytecode file's source (``pkg/__pycache__/mod.cpython-312.pyc`` → ``pkg/mod.py``); else ``path``."""
    folder, name = os.path.split(path)
    if os.path.basename(folder) != "__pycache__" or not name.endswith(".pyc"):
        return path
    return os.path.join(os.path.dirname(folder), name.split(".", 1)[0] + ".py")


def _writes(args: tuple[Any, ...]) -> bool:
    """Whether an ``open`` event (path, mode, flags) opened for writing: only what a test reads is an input."""
    mode = args[1] if len(args) > 1 else None
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    flags = args[2] if len(args) > 2 else 0
    return isinstance(flags, int) and bool(flags & _WRITES)


def _directory(args: tuple[Any, ...]) -> bool:
    """Whether an ``open`` event opened a directory (``os.open(..., O_DIRECTORY)``): a walk, not an input."""
    flags = args[2] if len(args) > 2 else 0
    return isinstance(flags, int) and bool(flags & getattr(os, "O_DIRECTORY", 0))


def mapped_files(maps: str) -> set[str]:
    """The files named in a ``/proc/<pid>/maps`` text (shared libraries, mapped data)."""
    found = set()
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            found.add(parts[5].removesuffix(" (deleted)"))
    return found


def _maps() -> set[str]:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        return mapped_files(maps.read())


class Recorder:
    """Records what each test of this process touched; see the module's docstring."""

    def __init__(self, root: Path, members: Mapping[str, str], *, excluded: Iterable[str] = (),
                 others: Iterable[str] = (), always: Iterable[str] = ()) -> None:
        self.root = os.path.normpath(os.path.abspath(root))
        self.members = dict(members)
        self.names = frozenset(os.path.basename(p) for p in self.members)
        self.packages = frozenset(k[len(WHEEL):].split("/", 1)[0].removesuffix(".py") for k in self.members.values()
                                  if not k.startswith(f"{WHEEL}{DIST_INFO}/"))
        self.excluded = tuple(os.path.normpath(os.path.abspath(p)) for p in excluded)
        self.others = frozenset(os.path.normpath(os.path.abspath(p)) for p in others)  # the suite's other tests
        self.always = tuple(always)
        # (event, its arguments, the working directory of a relative open: "" when absolute, None if unknown)
        self.events: list[tuple[str, tuple[Any, ...], str | None]] = []
        self.installed = False
        # What the process held when the recorder was made (the fork server after collection): every test
        # counts it, and each test walks only what came after.
        self.base_keys: frozenset[str] = frozenset()
        self.base_modules: frozenset[str] = frozenset()
        self.base_maps: frozenset[str] = frozenset()

    def snapshot(self) -> None:
        """Record what this process holds now as every later test's input (the fork server calls it once)."""
        keys: set[str] = set()
        self.base_maps = frozenset(_maps())
        self.base_modules = frozenset(sys.modules)
        for path in self.base_maps:
            self._add(keys, path, module=True)
        for name in self.base_modules:
            self._add_module(keys, name)
        self.base_keys = frozenset(keys)

    def install(self) -> None:
        """Add the audit hook (for the life of this process: PEP 578 hooks cannot be removed)."""
        append, watched, fspath, getcwd = self.events.append, EVENTS, os.fspath, os.getcwd

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event not in watched:
                return
            cwd: str | None = ""
            if event == "open" and not isinstance(args[0], int):
                # A relative path is resolved against the directory it was opened in (a test may chdir).
                try:
                    cwd = "" if fspath(args[0])[:1] in ("/", b"/") else getcwd()
                except Exception:  # the hook must never fail the open it watches; the record is dropped
                    cwd = None
            append((event, args, cwd))

        try:
            sys.addaudithook(hook)
        except Exception as exc:  # another hook refused ours: this process records nothing
            logger.warning("the audit hook that records what tests touch was refused: %s", exc)
            return
        self.installed = True

    def exclude(self, folder: str | os.PathLike[str]) -> None:
        """Never count files under ``folder`` (Kiln's work directory: results, stacks) as the test's inputs."""
        self.excluded = (*self.excluded, os.path.normpath(os.path.abspath(folder)))

    def begin(self) -> None:
        self.events.clear()

    def finish(self, test_file: str | os.PathLike[str]) -> tuple[str, ...]:
        """The sorted keys of what the test in ``test_file`` touched since :meth:`begin`; () if not recorded."""
        if not self.installed:
            return ()
        try:
            return tuple(sorted(self._keys(os.path.normpath(os.path.abspath(test_file)))))
        except Exception as exc:  # a record is never partial, and recording never fails a test
            logger.warning("what %s touched was not recorded: %s: %s", test_file, type(exc).__name__, exc)
            return ()

    def _keys(self, test_file: str) -> set[str]:
        keys = {*self.always, *self._own(test_file), *self.base_keys}
        tried: set[str] = set()
        for event, args, cwd in list(self.events):
            if event == "import":
                tried.add(str(args[0]))
            elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and not _directory(args):
                if cwd is None:
                    raise RuntimeError(f"{args[0]!r} was opened from a working directory that cannot be known")
                self._add(keys, os.path.join(cwd, os.fsdecode(args[0])), writes=_writes(args))
            elif event == "ctypes.dlopen" and isinstance(args[0], (str, bytes)) and "/" in os.fsdecode(args[0]):
                self._add(keys, os.fsdecode(args[0]))
        for path in _maps() - self.base_maps:
            self._add(keys, path, module=True)
        for name in sys.modules.keys() - self.base_modules:
            self._add_module(keys, name)
        for name in tried:
            if name.partition(".")[0] in self.packages and name not in sys.modules:
                stem = name.replace(".", "/")
                keys.update({f"{WHEEL}{stem}.py", f"{WHEEL}{stem}/__init__.py"})
        return keys

    def _add_module(self, keys: set[str], name: str) -> None:
        file = getattr(sys.modules.get(name), "__dict__", {}).get("__file__")
        if isinstance(file, str):
            self._add(keys, file, module=True)

    def _own(self, test_file: str) -> list[str]:
        """The test's file and the ``conftest.py`` of each folder from its own up to the root."""
        if not _under(test_file, self.root):
            return []
        keys = [self._relative(test_file)]
        folder = os.path.dirname(test_file)
        while _under(folder, self.root):
            keys.append(self._relative(os.path.join(folder, "conftest.py")))
            if folder == self.root:
                break
            folder = os.path.dirname(folder)
        return keys

    def _add(self, keys: set[str], path: str, *, writes: bool = False, module: bool = False) -> None:
        path = _source_of(os.path.normpath(os.path.abspath(path)))
        key = self.members.get(path)
        if key is None and os.path.basename(path) in self.names:
            key = self.members.get(os.path.realpath(path))
        if key is not None:
            keys.add(key)
            return
        if writes or not _under(path, self.root) or any(_under(path, e) for e in self.excluded):
            return
        if (module or path.endswith(".py")) and (path in self.others or os.path.basename(path) == "conftest.py"):
            return  # another test file, or a conftest outside this test's chain (its own are in _own)
        keys.add(self._relative(path))

    def _relative(self, path: str) -> str:
        return TEST + Path(os.path.relpath(path, self.root)).as_posix()


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def make_recorder(root: Path, test_files: Iterable[str | os.PathLike[str]], excluded: Iterable[str] = (),
                  inifile: Path | None = None) -> Recorder | None:
    """The recorder of a worker whose suite collected ``test_files`` under ``root``; None (nothing is
    recorded) when the tested distribution is unknown or not installed here."""
    name = tested_distribution()
    members = installed_members(name) if name else {}
    if not members:
        why = f"{name!r} has no RECORD here" if name else f"is not named ({TESTED_ENV} unset, no import guard)"
        logger.info("tests record nothing of what they touch: the tested distribution %s", why)
        return None
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix}
    sites = {p for p in sys.path if os.path.isabs(p) and os.path.basename(p) in ("site-packages", "dist-packages")}
    always = []
    if inifile is not None and _under(os.path.abspath(inifile), os.path.abspath(root)):
        always.append(TEST + Path(os.path.relpath(inifile, root)).as_posix())
    recorder = Recorder(root, members, excluded=[*excluded, *prefixes, *sites], others=[str(f) for f in test_files],
                        always=always)
    recorder.snapshot()
    return recorder


# --- fingerprints: what the selection compares between runs ------------------------------------------------


def fingerprint(keys: Iterable[str], wheel: Path, root: Path) -> dict[str, str]:
    """{key: sha256 hex} of each key: ``wheel:`` keys from the member's bytes in ``wheel`` (METADATA without its
    ``Version:`` line), ``test:`` keys from the file under ``root``; :data:`ABSENT` for a missing one."""
    keys = list(keys)
    out: dict[str, str] = {}
    wanted = [k for k in keys if k.startswith(WHEEL)]
    if wanted:
        out.update(_wheel_fingerprints(wanted, Path(wheel)))
    for key in keys:
        if key.startswith(TEST):
            out[key] = _file_fingerprint(key, Path(root))
        elif not key.startswith(WHEEL):
            raise InvalidInputError(f"touched key {key!r} is neither {WHEEL}<member> nor {TEST}<path>")
    return out


def _wheel_fingerprints(keys: list[str], wheel: Path) -> dict[str, str]:
    out = {}
    # Imported here, on Kiln's side only: the recording half of this module runs in the test worker on the
    # suite's interpreter, which may be a Python 3.10 cell, and kiln.core.wheels needs 3.11.
    from kiln.core.wheels import MAX_TOTAL_INFLATED, open_wheel, read_member

    with open_wheel(wheel.name, wheel) as archive:
        names = set(archive.namelist())
        info = next((n.split("/", 1)[0] for n in sorted(names) if n.split("/", 1)[0].endswith(".dist-info")), "")
        budget = MAX_TOTAL_INFLATED
        for key in keys:
            member = key[len(WHEEL):]
            if member.startswith(f"{DIST_INFO}/"):
                rest = member[len(DIST_INFO) + 1:]
                member = "" if rest == "RECORD" or not info else f"{info}/{rest}"
            if member not in names:
                out[key] = ABSENT
            elif member == f"{info}/METADATA":
                out[key] = hashlib.sha256(unstamped_metadata(read_member(archive, member, wheel.name))).hexdigest()
            else:
                digest = hashlib.sha256()
                with archive.open(member) as handle:
                    for block in iter(lambda: handle.read(_CHUNK), b""):
                        budget -= len(block)
                        if budget < 0:
                            raise MemberTooLargeError(
                                f"{wheel.name}: members inflate past {MAX_TOTAL_INFLATED} bytes while fingerprinting"
                                f" {key}; the wheel is broken or hostile")
                        digest.update(block)
                out[key] = digest.hexdigest()
    return out


def unstamped_metadata(metadata: bytes) -> bytes:
    """METADATA without its ``Version:`` header line: the one field a nightly's stamp changes."""
    head, sep, body = metadata.partition(b"\n\n")
    lines = [ln for ln in head.split(b"\n") if not ln.lower().startswith(b"version:")]
    return b"\n".join(lines) + sep + body


def _file_fingerprint(key: str, root: Path) -> str:
    relative = key[len(TEST):]
    root = root.resolve()
    path = (root / relative).resolve()
    if os.path.isabs(relative) or not path.is_relative_to(root):
        raise InvalidInputError(f"touched key {key!r} leaves the project root {root}")
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return ABSENT
    return hashlib.sha256(data).hexdigest()


_LIST_DISTRIBUTIONS = (
    "import json, importlib.metadata as m\n"
    "print(json.dumps(sorted({(d.metadata['Name'] or '', d.version or '') for d in m.distributions()})))\n"
)


def environment_lock(python: str | Path, tested: str) -> str:
    """sha256 over the sorted ``name==version`` of every distribution ``python``'s environment holds but
    ``tested``: what a test's result depends on besides its recorded keys."""
    from packaging.utils import canonicalize_name

    if not Path(python).is_file():
        raise InvalidInputError(f"environment_lock: interpreter {python} does not exist")
    try:
        done = subprocess.run([str(python), "-I", "-c", _LIST_DISTRIBUTIONS], capture_output=True, text=True,
                              timeout=LOCK_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"listing the distributions of {python} took over {LOCK_TIMEOUT_S:g}s") from exc
    if done.returncode != 0:
        raise InfrastructureError(f"listing the distributions of {python} failed (exit {done.returncode}): "
                                  f"{done.stderr.strip()[-1000:]}")
    skip = canonicalize_name(tested)
    pins = sorted({f"{canonicalize_name(name)}=={version}" for name, version in json.loads(done.stdout)
                   if name and canonicalize_name(name) != skip})
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()
