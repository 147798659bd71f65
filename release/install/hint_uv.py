"""The uv form of a printed install hint: parsed, resolved without installing, and its install command.

Kiln prints one uv command (:func:`kiln.release.install.installer.printed_uv`): ``env -u UV_CONFIG_FILE -u … uv
pip install
--no-config`` and uv's index options, with the Kiln index ranked first under uv's first-index strategy. uv takes
each project from the first index that holds it, so a held name comes from the Kiln index; a hint that ranks
another index first does not, which only a resolution shows. The resolution is ``uv pip compile`` to a PEP 751
lock (``pylock.toml``: each chosen wheel's URL and SHA-256), wheels only, nothing installed, so a wheel's
``.pth`` never runs inside the check. uv reads no pip configuration, and ``--no-config`` with the ``env -u``
of the variables that add a source leaves only the command line: unlike pip's hint, there is no caller's
configuration to judge it under.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from kiln.core.errors import InvalidInputError
from kiln.core.installenv import run_installer
from kiln.core.venvs import uv_command
from kiln.release.install.installer import check_index_url
from kiln.release.install.provenance import Chosen

UV = ("uv", "pip", "install")
URL_OPTIONS = ("--index", "--default-index", "--index-url", "--extra-index-url")
# uv options Kiln prints whose value is fixed: another value changes which index wins a name
FIXED = {"--preview-features": "wheel-variants", "--index-strategy": "first-index"}
FLAGS = ("--no-config", "--no-deps")
_UNSETTABLE = re.compile(r"(UV|PIP)_[A-Z0-9_]+")
_TAIL = 1500


def is_uv(argv: list[str]) -> bool:
    """Whether ``argv`` (one command of a hint) is a uv install, bare or after ``env -u NAME …``."""
    return _after_unset(argv)[1][:3] == list(UV)


def _after_unset(argv: list[str]) -> tuple[list[str], list[str]]:
    """The names ``env -u NAME …`` removes, and the command after them."""
    if argv[:1] != ["env"]:
        return [], argv
    names, rest = [], argv[1:]
    while len(rest) >= 2 and rest[0] == "-u":
        names.append(rest[1])
        rest = rest[2:]
    return names, rest


def parse_uv(text: str, argv: list[str]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
    """(the names the command unsets, its uv options, its requirements); InvalidInputError naming the hint when
    it is not a uv command as Kiln prints it."""
    unset, command = _after_unset(argv)
    for name in unset:
        if not _UNSETTABLE.fullmatch(name):
            raise InvalidInputError(f"install hint {text!r}: unsets {name!r}; a uv hint Kiln prints unsets only UV_* "
                                    "and PIP_* variables")
    options: list[str] = []
    requirements: list[str] = []
    rest = iter(command[len(UV):])
    for arg in rest:
        flag, eq, value = arg.partition("=")
        if flag in URL_OPTIONS or flag in FIXED:
            value = value if eq else next(rest, "")
            options += [flag, _checked(text, flag, value)]
        elif arg in FLAGS:
            options.append(arg)
        elif arg.startswith("-"):
            raise InvalidInputError(f"install hint {text!r}: uv option {arg!r} is not one Kiln prints "
                                    f"({', '.join(sorted([*URL_OPTIONS, *FIXED, *FLAGS]))})")
        else:
            requirements.append(arg)
    if "--no-config" not in options:
        raise InvalidInputError(f"install hint {text!r}: a uv hint Kiln prints has --no-config (without it uv adds "
                                "the sources its configuration files name)")
    return tuple(unset), tuple(options), requirements


def _checked(text: str, flag: str, value: str) -> str:
    if flag in FIXED:
        if value != FIXED[flag]:
            raise InvalidInputError(f"install hint {text!r}: {flag} {value!r}; Kiln prints only {FIXED[flag]!r}")
        return value
    try:
        return check_index_url(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"install hint {text!r}: {exc}") from exc


def kiln_index(options: tuple[str, ...]) -> str:
    """The index a uv command takes every name it holds from: the first ``--index`` (first-index), else its
    ``--default-index`` (or ``--index-url``)."""
    values = list(zip(options, options[1:], strict=False))
    ranked = [value for flag, value in values if flag == "--index"]
    default = [value for flag, value in values if flag in ("--default-index", "--index-url")]
    return ranked[0] if ranked else default[-1] if default else ""


def install_command(python: Path, options: tuple[str, ...], requirements: list[str]) -> list[str]:
    """The uv install the hint runs, into ``python``'s environment, wheels only, no cache of the user's."""
    return [*uv_command(), "pip", "install", "--python", str(python), "--no-cache", "--only-binary", ":all:",
            *options, *requirements]


def resolve(python: Path, options: tuple[str, ...], requirements: list[str], unset: tuple[str, ...], cwd: Path,
            timeout: float) -> list[Chosen] | str:
    """Every wheel uv would choose for ``requirements`` under ``options``, nothing installed; or why none."""
    lock, wanted = cwd / "pylock.toml", cwd / "hint-requirements.in"
    wanted.write_text("".join(f"{r}\n" for r in requirements))
    cmd = [*uv_command(), "pip", "compile", "--python", str(python), "--no-cache", "--only-binary", ":all:",
           "--format", "pylock.toml", "-o", str(lock), *_without_variants(options), str(wanted)]
    what = f"resolving uv pip install {' '.join([*options, *requirements])}"
    try:
        done = run_installer(cmd, cwd, timeout, unset=unset)
    except subprocess.TimeoutExpired:
        return f"{what}: timed out after {timeout:.0f} s"
    except OSError as exc:
        return f"{what}: cannot run uv: {exc}"
    if done.returncode != 0:
        return f"{what} failed: {(done.stderr or done.stdout).strip()[-_TAIL:]}"
    return read_lock(lock)


def _without_variants(options: tuple[str, ...]) -> list[str]:
    """``options`` less uv's wheel-variants preview: uv's lock cannot hold a variant wheel, and which index a name
    comes from does not depend on it (first-index: the first index holding any file of the name), so the lock
    of the default wheels names the same indexes the install reads."""
    kept, skip = [], False
    for word in options:
        if not skip and word != "--preview-features":
            kept.append(word)
        skip = word == "--preview-features"  # and the value after it
    return kept


def read_lock(path: Path) -> list[Chosen]:
    """Each wheel a PEP 751 lock lists, as a :class:`Chosen`; InvalidInputError naming it when it is not one."""
    try:
        data = tomllib.loads(path.read_text())
        return [Chosen(package["name"], package["version"], wheel["url"], wheel["hashes"]["sha256"])
                for package in data.get("packages", []) for wheel in package.get("wheels", [])]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InvalidInputError(f"uv's lock {path} is not a PEP 751 lock with wheel hashes: {exc}") from exc


__all__ = ["install_command", "is_uv", "kiln_index", "parse_uv", "read_lock", "resolve"]
