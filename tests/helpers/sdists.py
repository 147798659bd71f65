"""Hostile source distributions for supply-chain tests: an sdist whose build hook records what it could steal."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Mapping
from io import BytesIO
from pathlib import Path


def evil_sdist_index(root: Path, markers: Path, name: str = "evil-sdist", version: str = "1.0") -> str:
    """A file:// index whose only file of ``name`` (default ``evil-sdist``) is an sdist of ``version``; its
    in-tree build backend writes a marker holding the environment it ran with (what it could steal) when it is
    imported."""
    backend = (f"import json, os, pathlib\npathlib.Path({str(markers)!r}).mkdir(exist_ok=True)\n"
               f"pathlib.Path({str(markers)!r}, str(os.getpid())).write_text(json.dumps(dict(os.environ)))\n")
    return _sdist_index(root, backend, name, version)


# A build backend that tries, when imported, to read ``secret`` and to write beside ``outside`` (what a hostile
# hook would do to the user's files), and reports what it managed and the environment it saw under the one place
# it may write that the test can find: the installer's cache ($UV_CACHE_DIR, else $PIP_CACHE_DIR).
_PROBE = """import json, os, pathlib
report = {"environ": dict(os.environ)}
try:
    report["secret"] = pathlib.Path(%(secret)r).read_text()
except OSError as exc:
    report["secret_error"] = type(exc).__name__
try:
    pathlib.Path(%(outside)r).write_text("written by a build hook")
    report["wrote_outside"] = True
except OSError as exc:
    report["wrote_outside"] = False
cache = os.environ.get("UV_CACHE_DIR") or os.environ["PIP_CACHE_DIR"]
pathlib.Path(cache, "probe-%%d.json" %% os.getpid()).write_text(json.dumps(report))
"""


def probing_sdist_index(root: Path, secret: Path, outside: Path, name: str = "probe-sdist") -> str:
    """A file:// index of one sdist whose build hook probes ``secret`` (read) and ``outside`` (write) and leaves
    its report as ``probe-<pid>.json`` in the installer's cache."""
    return _sdist_index(root, _PROBE % {"secret": str(secret), "outside": str(outside)}, name, "1.0")


def write_sdist(folder: Path, name: str, version: str, members: Mapping[str, bytes]) -> Path:
    """``<folder>/<name>-<version>.tar.gz``: ``members`` (paths below the sdist's root folder, in order) and the
    PKG-INFO naming ``name`` and ``version``."""
    stem = f"{name.replace('-', '_')}-{version}"
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    sdist = folder / f"{stem}.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for member, data in {**members, "PKG-INFO": pkg_info}.items():
            info = tarfile.TarInfo(f"{stem}/{member}")
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, BytesIO(data))
    return sdist


def _sdist_index(root: Path, backend: str, name: str, version: str) -> str:
    page = root / "simple" / name
    page.mkdir(parents=True)
    pyproject = '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    sdist = write_sdist(page, name, version, {"pyproject.toml": pyproject.encode(), "backend.py": backend.encode()})
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    (page / "index.html").write_text(f'<a href="{sdist.name}#sha256={digest}">{sdist.name}</a>\n')
    (root / "simple" / "index.html").write_text(f'<a href="{name}/">{name}</a>\n')
    return (root / "simple").as_uri() + "/"
