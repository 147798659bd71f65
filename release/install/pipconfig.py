"""The caller's own pip configuration: what a ``pip install`` run in the caller's shell would add behind the
indexes the command names.

pip merges into every resolution the ``extra-index-url`` and ``find-links`` of its configuration files and of
``PIP_EXTRA_INDEX_URL``/``PIP_FIND_LINKS``. An install Kiln runs itself sees none of them (a private ``HOME``,
the scrubbed environment of :mod:`kiln.core.installenv`), so ``kiln verify --hint`` judges a printed command
a second time under what :func:`caller_pip_config` reads here, and names the setting whose source would win a
name the Kiln index holds.

The files are those pip reads, in its order: the global ones (``/etc/xdg/pip/pip.conf``, ``/etc/pip.conf``),
then the one ``PIP_CONFIG_FILE`` names or else the user's (``~/.pip/pip.conf``, ``$XDG_CONFIG_HOME/pip/pip.conf``
or ``~/.config/pip/pip.conf``); the null device as ``PIP_CONFIG_FILE`` means none at all.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

GLOBAL_FILES = (Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"))
VARIABLES = ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS")
_KEYS = {"extra-index-url": "extra-index-url", "extra_index_url": "extra-index-url",
         "find-links": "find-links", "find_links": "find-links"}
_SECTIONS = ("global", "install")


@dataclass(frozen=True)
class Source:
    """One index or find-links location the configuration adds: where it is set, and its URL or path."""

    where: str  # "PIP_EXTRA_INDEX_URL", or "find-links in /home/u/.config/pip/pip.conf"
    url: str

    def __str__(self) -> str:
        return f"{self.where} = {self.url}"


@dataclass(frozen=True)
class PipConfig:
    """The caller's pip configuration, as an installer subprocess's environment carries it (``env``: the
    variables and, as ``PIP_CONFIG_FILE``, the user's file, since that subprocess's ``HOME`` is a private one),
    and every source it adds."""

    env: Mapping[str, str]
    sources: tuple[Source, ...]

    def named(self, url: str) -> list[Source]:
        """The sources a file at ``url`` can have come from: those it lies under, else those on its host;
        every source when none matches."""
        under = [s for s in self.sources if _location(url).startswith(_location(s.url).rstrip("/") + "/")]
        host = [s for s in self.sources if urlsplit(s.url)[:2] == urlsplit(url)[:2] and urlsplit(url).netloc]
        return under or host or list(self.sources)


def _location(text: str) -> str:
    """A find-links path as a file URL, so a file pip found there compares with it."""
    return text if "://" in text else Path(text).absolute().as_uri()


def _user_file(environ: Mapping[str, str], home: Path) -> Path | None:
    configured = environ.get("PIP_CONFIG_FILE")
    if configured:
        return Path(configured)
    xdg = Path(environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf"
    legacy = home / ".pip" / "pip.conf"
    return xdg if xdg.is_file() else legacy if legacy.is_file() else None


def _file_sources(path: Path) -> list[Source]:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:  # pip refuses such a file too; say which it is
        return [Source(f"unreadable pip configuration {path} ({exc})", "")]
    found = []
    for section in _SECTIONS:
        if parser.has_section(section):
            for key, value in parser.items(section):
                if key in _KEYS:
                    found += [Source(f"{_KEYS[key]} in {path}", url) for url in value.split()]
    return found


def caller_pip_config(environ: Mapping[str, str], home: Path) -> PipConfig:
    """What pip run by the caller (``environ``, ``home``) reads besides a command's own options."""
    user = _user_file(environ, home)
    if user is not None and str(user) == os.devnull:
        files: Sequence[Path] = ()
    else:
        files = [p for p in (*GLOBAL_FILES, *([user] if user else [])) if p.is_file()]
    sources = [s for path in files for s in _file_sources(path)]
    sources += [Source(name, url) for name in VARIABLES for url in environ.get(name, "").split()]
    env = {name: environ[name] for name in VARIABLES if environ.get(name)}
    if user is not None:
        env["PIP_CONFIG_FILE"] = str(user)
    return PipConfig(env, tuple(sources))


__all__ = ["PipConfig", "Source", "caller_pip_config"]
