"""Hostile source distributions for supply-chain tests: an sdist whose build hook records what it could steal."""

from __future__ import annotations

import hashlib
import tarfile
from io import BytesIO
from pathlib import Path


def evil_sdist_index(root: Path, markers: Path, name: str = "evil-sdist", version: str = "1.0") -> str:
    """A file:// index whose only file of ``name`` (default ``evil-sdist``) is an sdist of ``version``; its
    in-tree build backend writes a marker holding the environment it ran with (what it could steal) when it is
    imported."""
    backend = (f"import json, os, pathlib\npathlib.Path({str(markers)!r}).mkdir(exist_ok=True)\n"
               f"pathlib.Path({str(markers)!r}, str(os.getpid())).write_text(json.dumps(dict(os.environ)))\n")
    stem = f"{name.replace('-', '_')}-{version}"
    members = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
               "backend.py": backend, "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
    page = root / "simple" / name
    page.mkdir(parents=True)
    sdist = page / f"{stem}.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for member, text in members.items():
            info = tarfile.TarInfo(f"{stem}/{member}")
            info.size = len(text.encode())
            archive.addfile(info, BytesIO(text.encode()))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    (page / "index.html").write_text(f'<a href="{sdist.name}#sha256={digest}">{sdist.name}</a>\n')
    (root / "simple" / "index.html").write_text(f'<a href="{name}/">{name}</a>\n')
    return (root / "simple").as_uri() + "/"
