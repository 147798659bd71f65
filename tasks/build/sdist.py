"""The project's sdist, for an upload target that ships one (``[publish.targets.<name>] sdist = true``).

Only a ``[build] backend = "pep517"`` project has one: a package whose own
pyproject.toml or setup.py builds it, so its sources are what a user can build
from. Kiln's own wheel builder (a registry package such as the bundled
``kernels/``) compiles the kernels ahead of time into each variant's wheel;
its sources alone build nothing a user would install, so it ships wheels only.

The sdist is built with pypa/build's :class:`build.ProjectBuilder` from a
private copy of the project (:func:`kiln.tasks.build.sources.copy_project`, as
the wheel), in a fresh build environment on Kiln's interpreter with the
project's build requirements (those it lacks installed by pip in the scrubbed
environment, :func:`kiln.tasks.build.guest_install.pip_env`); the backend's hooks
run as the wheel's do: no download host reachable
(:func:`kiln.tasks.build.guest_install.without_network`), the commit's
``SOURCE_DATE_EPOCH``, in their own process group under a deadline. It is
built at the release's public version: setuptools-scm is told it
(``SETUPTOOLS_SCM_PRETEND_VERSION``); a project whose version is written in
its files must state that version, or its sdist is refused naming both.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import build
from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from kiln.core import venvs
from kiln.core.errors import CompileError
from kiln.release.upload.pypi_release import public_version
from kiln.tasks.build.guest_install import hook_failure, hook_runner, install_build_requirements, without_network
from kiln.tasks.build.reproducible import commit_time, path_maps, reproducible_environ
from kiln.tasks.build.sources import copy_project

_log = logging.getLogger(__name__)


def sdist_environ(base: Mapping[str, str], distribution: str, version: str) -> dict[str, str]:
    """The hooks' environment: ``base`` with no download host reachable and ``version`` for setuptools-scm."""
    env = without_network(base)
    scm_name = canonicalize_name(distribution).replace("-", "_").upper()
    return env | {"SETUPTOOLS_SCM_PRETEND_VERSION": version, f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_{scm_name}": version}


def _hook_failure(what: str, exc: Exception) -> CompileError:
    return CompileError(f"the build backend could not make the sdist of {what}: {hook_failure(exc)}")


def check_sdist(path: Path, distribution: str, version: str) -> None:
    """CompileError unless ``path`` is an sdist of ``distribution`` at ``version`` (its name says both)."""
    try:
        name, stated = parse_sdist_filename(path.name)
    except InvalidSdistFilename as exc:
        raise CompileError(f"the build backend of {distribution} left {path.name!r}, not an sdist name: {exc}") from exc
    if name != canonicalize_name(distribution):
        raise CompileError(f"the sdist {path.name} is of {name!r}, but kiln.toml's project.distribution is"
                           f" {distribution!r}; make them agree")
    if stated != Version(version):
        raise CompileError(f"the sdist {path.name} states version {stated}, but the release is {version}: write"
                           f" {version} in the project's version, or derive it with setuptools-scm (Kiln tells it"
                           " the release's version); the sdist is not uploaded")


def build_sdist(project_dir: Path, distribution: str, version: str, out_dir: Path, timeout_s: float,
                exclude: Sequence[Path] = ()) -> Path:
    """Build the project's sdist at ``version``'s public version into ``out_dir``; its path (see module docs)."""
    public = public_version(version)
    what = f"{distribution} {public}"
    with tempfile.TemporaryDirectory(prefix="kiln-sdist-") as tmp:
        work = Path(tmp)
        source = copy_project(project_dir, work / "src", exclude)
        python = venvs.make_build_env(work / "env")
        environ = reproducible_environ(sdist_environ(os.environ, distribution, public),
                                       path_maps(source, work, None), commit_time(project_dir))
        builder = build.ProjectBuilder(source, python_executable=str(python),
                                       runner=hook_runner(environ, timeout_s, work))
        _log.info("building the sdist of %s with its own backend", what)
        try:
            install_build_requirements(python, list(builder.build_system_requires), what, timeout_s)
            install_build_requirements(python, list(builder.get_requires_for_build("sdist")), what, timeout_s)
            built = Path(builder.build("sdist", work / "dist"))
        except (build.BuildException, build.BuildBackendException) as exc:
            raise _hook_failure(what, exc) from exc
        check_sdist(built, distribution, public)
        out_dir.mkdir(parents=True, exist_ok=True)
        staged = out_dir / f".{built.name}.part"
        shutil.copyfile(built, staged)
        final = out_dir / built.name
        os.replace(staged, final)  # atomic: a reader never sees half an sdist
    _log.info("built %s", final.name)
    return final


__all__ = ["build_sdist", "check_sdist", "sdist_environ"]
