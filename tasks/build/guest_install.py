"""Build requirements installed as a guest, and the local sources among them built without network.

pip installs what a build environment lacks in the sandbox (:func:`kiln.core.sandbox.installer_command`): the
machine's network, for its index, but only wheels from that index, so no index package's code runs while it
installs. A requirement may also name a local source itself (``helper @ file:///…/helper-1.0.tar.gz``, a
directory): that is package code too, and an installer given it would run its PEP 517 hook with the installer's
network. Kiln builds such a source first, as it builds a project: its own build requirements installed as above
(wheels only, a local one among them built the same way, to :data:`MAX_DEPTH`), then its hooks in the sandbox
with **no network** (:func:`hook_runner`), in a private copy, writing only that copy. The installer is then given
the wheel it made: a build that downloads fails instead of fetching, as the project's own build does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

import build
from packaging.requirements import InvalidRequirement, Requirement

from kiln.core import venvs
from kiln.core.errors import CompileError
from kiln.core.installenv import scrubbed_env, user_cache
from kiln.core.sandbox import guest_command, guest_environ, installer_command, wheels_only_hint
from kiln.tasks.process import run_tool

_log = logging.getLogger(__name__)
_TAIL_CHARS = 4000
MAX_DEPTH = 4  # a local build requirement of a local build requirement of …: deeper is refused
_VENV_TIMEOUT_S = 300.0
# A project's build reaches no download host even where the kernel allows no sandbox: every proxy variable names a
# loopback port nothing serves, and no host is exempt, so a bdist_wheel that fetches someone else's prebuilt wheel
# (flash-attention's pattern) fails to connect and can never be published as Kiln's. A variant's build_env may set
# these variables back, deliberately.
REFUSING_PROXY = "http://127.0.0.1:9"
_PROXY_VARS = ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy")
_NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
# The machine's own package sources, kept for pip when it fills an environment (a local mirror of PyPI).
_MACHINE_SOURCES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT")
_SDIST_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


def without_network(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with every URL fetch routed to :data:`REFUSING_PROXY` (both spellings of each variable)."""
    env = {k: v for k, v in environ.items() if k not in _NO_PROXY_VARS}
    return env | {name: REFUSING_PROXY for var in _PROXY_VARS for name in (var, var.upper())}


def pip_env(home: Path) -> dict[str, str]:
    """pip's environment when it fills a build or test-base environment: scrubbed
    (:mod:`kiln.core.installenv`), since a requirement from an index may be an sdist whose build hook is
    someone else's code, with the machine's own sources and pip's cache kept; ``HOME`` is ``home``."""
    sources = {key: os.environ[key] for key in _MACHINE_SOURCES if key in os.environ}
    return scrubbed_env(home, extra={**sources, "PIP_CACHE_DIR": user_cache("pip", "PIP_CACHE_DIR")})


def hook_runner(environ: Mapping[str, str], timeout_s: float, work: Path) -> build.RunnerType:
    """pyproject-hooks' runner: each hook call in its own process group, under the deadline, in ``environ``
    (allow-listed), sandboxed: it writes ``work`` (the copied sources, its environment, the dist folder) and the
    control folder pyproject-hooks names on its command line; no network."""
    def run(cmd: Sequence[str], cwd: str | None = None, extra_environ: Mapping[str, str] | None = None) -> None:
        control = [arg for arg in cmd[1:] if os.path.isabs(arg) and os.path.isdir(arg)]
        done = run_tool(guest_command(list(cmd), read=[work], write=[work, *control], network="none"), timeout_s,
                        cwd=Path(cwd) if cwd else None,
                        env=guest_environ(work / "home", extra_environ, base=environ))
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, list(cmd), output=done.stdout)
    return run


def hook_failure(exc: Exception) -> str:
    """What a failed PEP 517 hook call says: the error and the tail of the hook's output."""
    cause = getattr(exc, "exception", None)
    output = str(getattr(cause, "output", "") or "")[-_TAIL_CHARS:].strip()
    return f"{exc}" + (f"; its log ends:\n{output}" if output else "")


def install_build_requirements(python: Path, requirements: Sequence[str], what: str, timeout_s: float,
                               flag: str = "-P", depth: int = 0) -> None:
    """Install what of ``requirements`` ``python``'s environment lacks: pip as a guest (:func:`installer_command`)
    in the scrubbed environment, writing only that environment; a local source among them built first, without
    network (:func:`offline_wheels`). ``flag``: how ``python`` keeps its working directory off ``sys.path``
    (``-P``; ``-I`` for Python 3.10)."""
    missing = venvs.unmet_requirements(python, sorted(requirements), flag)
    if missing:
        _pip_install(python, [m.rsplit(" (", 1)[0] for m in missing], what, timeout_s, flag, depth)


def _pip_install(python: Path, wanted: Sequence[str], what: str, timeout_s: float, flag: str, depth: int) -> None:
    _log.info("installing the build requirements %s for %s", wanted, what)
    with tempfile.TemporaryDirectory(prefix="kiln-pip-home-") as home:
        given = offline_wheels(wanted, python, Path(home) / "local-wheels", timeout_s, depth)
        cmd, env = installer_command([str(python), flag, "-m", "pip", "install", "--quiet", *given], python,
                                     pip_env(Path(home)), write=[python.parent.parent])
        done = run_tool(cmd, timeout_s, env=env)
    if done.returncode != 0:
        raise CompileError(f"cannot install the build requirements {wanted} of {what}"
                           f"{wheels_only_hint(done.stdout)}:\n{done.stdout[-_TAIL_CHARS:].strip()}")


def _location(requirement: str) -> str:
    """The URL or path ``requirement`` names (``name @ URL``, or a bare URL or path), else ""."""
    try:
        return Requirement(requirement).url or ""
    except InvalidRequirement:
        return requirement.strip()


def local_source(requirement: str) -> Path | None:
    """The directory or sdist on this machine that ``requirement`` names (``name @ file:///…``, ``file:///…``,
    an absolute path), else None: a name, a wheel file, a remote URL."""
    location = _location(requirement)
    if location.startswith("file:"):
        path = Path(unquote(urlparse(location).path))
    elif location.startswith("/"):
        path = Path(location)
    else:
        return None
    if path.is_dir() or (path.is_file() and path.name.endswith(_SDIST_SUFFIXES)):
        return path
    return None


# The PEP 508 marker environment of an interpreter, from the standard library alone (the environment of a fresh
# venv has no packaging to ask): the keys packaging.markers.default_environment gives.
_MARKER_ENV = r"""
import json, os, platform, sys
def version(info):
    text = f"{info.major}.{info.minor}.{info.micro}"
    return text if info.releaselevel == "final" else text + info.releaselevel[0] + str(info.serial)
print(json.dumps({"implementation_name": sys.implementation.name,
                  "implementation_version": version(sys.implementation.version), "os_name": os.name,
                  "platform_machine": platform.machine(), "platform_release": platform.release(),
                  "platform_system": platform.system(), "platform_version": platform.version(),
                  "python_full_version": platform.python_version(),
                  "platform_python_implementation": platform.python_implementation(),
                  "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}))
"""


def _marker_holds(requirement: str, python: Path, timeout_s: float) -> bool:
    """Whether ``requirement``'s marker holds for ``python`` (True without one): a local source whose marker is
    false for the target is neither built nor installed, as an installer would skip it."""
    try:
        marker = Requirement(requirement).marker
    except InvalidRequirement:
        return True
    if marker is None:
        return True
    done = run_tool([str(python), "-I", "-c", _MARKER_ENV], timeout_s)
    if done.returncode != 0:
        raise CompileError(f"{python} could not say its marker environment (for {requirement!r}):\n{done.stdout}")
    return marker.evaluate({**json.loads(done.stdout.strip().splitlines()[-1]), "extra": ""})


def offline_wheels(requirements: Sequence[str], python: Path, out: Path, timeout_s: float,
                   depth: int = 0) -> list[str]:
    """``requirements`` with each local source (:func:`local_source`) replaced by the wheel it builds for
    ``python``'s interpreter without network, into ``out``; the rest as given."""
    given = []
    for requirement in requirements:
        source = local_source(requirement)
        if source is None:
            _refuse_remote_source(requirement)
            given.append(requirement)
            continue
        if not _marker_holds(requirement, python, timeout_s):
            _log.info("not building %r: its marker is false for %s", requirement, python)
            continue
        if depth >= MAX_DEPTH:
            raise CompileError(f"the local build requirement {requirement!r} is nested {depth} deep in local"
                               f" sources; Kiln builds them {MAX_DEPTH} deep at most: publish one as a wheel")
        wheel = build_offline(source, python, out, timeout_s, depth + 1)
        try:
            named = Requirement(requirement)
        except InvalidRequirement:
            given.append(str(wheel))
            continue
        extras = f"[{','.join(sorted(named.extras))}]" if named.extras else ""
        marker = f" ; {named.marker}" if named.marker else ""
        given.append(f"{named.name}{extras} @ {wheel.as_uri()}{marker}")
    return given


def _refuse_remote_source(requirement: str) -> None:
    """A CompileError for a requirement naming a source by a remote URL (an sdist, a VCS checkout): an installer
    would build it with its network, and Kiln builds only a local copy without one."""
    url = _location(requirement)
    if "://" in url and not url.startswith("file:") and not urlparse(url).path.endswith(".whl"):
        raise CompileError(f"the build requirement {requirement!r} names a source by a remote URL, which an installer"
                           " would build with the network; download it (an sdist, a checkout) and name the local"
                           " file or folder, which Kiln builds without network, or name a wheel")


def build_offline(source: Path, python: Path, out: Path, timeout_s: float, depth: int = 1) -> Path:
    """The wheel ``source`` (a directory or an sdist) builds for ``python``'s interpreter: in a private copy and
    environment, its build requirements installed as a guest, its hooks sandboxed with no network; in ``out``."""
    what = f"the local build requirement {source}"
    with tempfile.TemporaryDirectory(prefix="kiln-local-build-") as tmp:
        work = Path(tmp)
        tree = _private_copy(source, work / "src")
        made = run_tool(venvs.venv_command(work / "env", python, pip=True), _VENV_TIMEOUT_S)
        if made.returncode != 0:
            raise CompileError(f"cannot make an environment to build {what}: {made.stdout[-_TAIL_CHARS:].strip()}")
        env_python = work / "env" / "bin" / "python"
        flag = venvs.safe_path_flag(env_python)
        builder = build.ProjectBuilder(tree, python_executable=str(env_python),
                                       runner=hook_runner(without_network(os.environ), timeout_s, work))
        _log.info("building %s without network, before the installer is given its wheel", what)
        try:
            # in order: the backend's own requirements before its hook is asked what else it needs
            # (a fresh environment holds none of them, nor packaging to check them)
            if builder.build_system_requires:
                _pip_install(env_python, sorted(builder.build_system_requires), what, timeout_s, flag, depth)
            if more := builder.get_requires_for_build("wheel"):
                _pip_install(env_python, sorted(more), what, timeout_s, flag, depth)
            built = Path(builder.build("wheel", work / "dist"))
        except (build.BuildException, build.BuildBackendException) as exc:
            raise CompileError(f"{what} could not be built without network (a build that downloads must be given"
                               f" its download as a build requirement): {hook_failure(exc)}") from exc
        out.mkdir(parents=True, exist_ok=True)
        final = out / built.name
        staged = out / f".{built.name}.part"
        shutil.copyfile(built, staged)
        os.replace(staged, final)  # atomic: the installer never sees half a wheel
    return final


def _top_build_dirs(root: Path) -> Callable[[str, list[str]], list[str]]:
    """copytree's ignore: ``.git`` anywhere, and the build leftovers at the source's top (``build/``,
    ``*.egg-info``), never a package's own ``build`` subpackage."""
    def ignore(folder: str, names: list[str]) -> list[str]:
        top = Path(folder) == root
        return [n for n in names if n == ".git" or (top and (n == "build" or n.endswith(".egg-info")))]
    return ignore


def _unpack(source: Path, dest: Path) -> None:
    """``source``'s tree copied (a directory) or unpacked (an sdist, no member outside it) at ``dest``."""
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True, ignore=_top_build_dirs(source))
    elif source.name.endswith(".zip"):
        with zipfile.ZipFile(source) as archive:
            for member in archive.namelist():
                if not (dest / member).resolve().is_relative_to(dest.resolve()):
                    raise CompileError(f"the sdist {source} has a member outside its folder: {member!r}")
            archive.extractall(dest)
    else:
        if not hasattr(tarfile, "data_filter"):
            raise CompileError(f"unpacking the sdist {source} safely needs Python 3.11.4 or newer (tarfile's data"
                               " filter); upgrade the interpreter Kiln runs on")
        with tarfile.open(source) as archive:
            try:
                archive.extractall(dest, filter="data")
            except tarfile.FilterError as exc:
                raise CompileError(f"the sdist {source} has a member that may not be unpacked: {exc}") from exc


def _private_copy(source: Path, dest: Path) -> Path:
    """``source``'s tree copied (a directory) or unpacked (an sdist, no member outside it) at ``dest``; the
    folder holding its pyproject.toml or setup.py."""
    try:
        _unpack(source, dest)
    except (tarfile.TarError, zipfile.BadZipFile) as exc:  # FilterError is a TarError: said by _unpack itself
        raise CompileError(f"the local build requirement {source} is not an sdist Kiln can unpack: {exc}") from exc
    if (dest / "pyproject.toml").exists() or (dest / "setup.py").exists():
        return dest
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) == 1 and ((tops[0] / "pyproject.toml").exists() or (tops[0] / "setup.py").exists()):
        return tops[0]
    raise CompileError(f"{source} holds no pyproject.toml or setup.py at its top: not a source Kiln can build")


__all__ = ["MAX_DEPTH", "REFUSING_PROXY", "build_offline", "hook_failure", "hook_runner",
           "install_build_requirements", "local_source", "offline_wheels", "pip_env", "without_network"]
