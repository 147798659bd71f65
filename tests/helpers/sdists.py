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


# A build backend that tries, when imported, to read ``secret``, to write beside ``outside`` (what a hostile hook
# would do to the user's files) and to reach ``connect`` (a listener, or None), and reports what it managed and the
# environment it saw: in the installer's cache ($UV_CACHE_DIR, else $PIP_CACHE_DIR) where it may write there, and in
# the wheel it builds (``probe_sdist_report.json``, installed beside the package's other files).
_PROBE = """import base64, hashlib, json, os, pathlib, socket, zipfile
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
if %(connect)r is not None:
    try:
        socket.create_connection(tuple(%(connect)r), timeout=5).close()
        report["connected"] = True
    except OSError:
        report["connected"] = False
try:
    cache = os.environ.get("UV_CACHE_DIR") or os.environ["PIP_CACHE_DIR"]
    pathlib.Path(cache, "probe-%%d.json" %% os.getpid()).write_text(json.dumps(report))
except (KeyError, OSError):
    pass


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    info = "%(stem)s.dist-info"
    files = {"probe_sdist_report.json": json.dumps(report).encode(),
             info + "/METADATA": b"Metadata-Version: 2.1\\nName: %(name)s\\nVersion: %(version)s\\n",
             info + "/WHEEL": b"Wheel-Version: 1.0\\nGenerator: probe\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    lines = ["%%s,sha256=%%s,%%d" %% (name, base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
             .decode(), len(data)) for name, data in files.items()]
    files[info + "/RECORD"] = ("\\n".join([*lines, info + "/RECORD,,"]) + "\\n").encode()
    name = "%(stem)s-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return name
"""


def probing_sdist_index(root: Path, secret: Path, outside: Path, name: str = "probe-sdist",
                        connect: tuple[str, int] | None = None) -> str:
    """A file:// index of one sdist whose build hook probes ``secret`` (read), ``outside`` (write) and ``connect``
    (a TCP address, or None) and leaves its report as ``probe-<pid>.json`` in the installer's cache where it may
    write there, and as ``probe_sdist_report.json`` in the wheel it builds."""
    stem = f"{name.replace('-', '_')}-1.0"
    probe = _PROBE % {"secret": str(secret), "outside": str(outside), "connect": list(connect) if connect else None,
                      "stem": stem, "name": name, "version": "1.0"}
    return _sdist_index(root, probe, name, "1.0")


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
