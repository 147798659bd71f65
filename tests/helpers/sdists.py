"""Hostile source distributions for supply-chain tests: an sdist whose build hook records what it could steal."""

from __future__ import annotations

import hashlib
import tarfile
from io import BytesIO
from pathlib import Path


def evil_sdist_index(root: Path, markers: Path) -> str:
    """A file:// index whose only file of ``evil-sdist`` is an sdist; its in-tree build backend writes a marker
    holding the environment it ran with (what it could steal) when it is imported."""
    backend = (f"import json, os, pathlib\npathlib.Path({str(markers)!r}).mkdir(exist_ok=True)\n"
               f"pathlib.Path({str(markers)!r}, str(os.getpid())).write_text(json.dumps(dict(os.environ)))\n")
    members = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
               "backend.py": backend, "PKG-INFO": "Metadata-Version: 2.1\nName: evil-sdist\nVersion: 1.0\n"}
    page = root / "simple" / "evil-sdist"
    page.mkdir(parents=True)
    sdist = page / "evil_sdist-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in members.items():
            info = tarfile.TarInfo(f"evil_sdist-1.0/{name}")
            info.size = len(text.encode())
            archive.addfile(info, BytesIO(text.encode()))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    (page / "index.html").write_text(f'<a href="{sdist.name}#sha256={digest}">{sdist.name}</a>\n')
    (root / "simple" / "index.html").write_text('<a href="evil-sdist/">evil-sdist</a>\n')
    return (root / "simple").as_uri() + "/"
