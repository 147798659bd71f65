"""A test base made from what Kiln's interpreter already has installed, instead of a second pip install.

The base of a suite's environment (:mod:`.baseenv`) holds torch, Triton, numpy, pytest and pydantic at the
versions of Kiln's interpreter. A first run used to make it with ``pip install`` from the machine's
sources: the same wheels pip had unpacked for Kiln's own environment minutes before, unpacked and
byte-compiled again (1.5 GB; 40-150 s of the README's first command, ``benchmarks/RESULTS.md``).

:func:`host_distributions` finds, in Kiln's own site-packages, exactly the distributions such a base holds:
each pinned one at exactly its pinned version (a local label counts: ``2.13.0`` is not ``2.13.0+cpu``), the
closure of their ``Requires-Dist`` (markers evaluated here), and the installer seed
(:data:`~kiln.tasks.build.buildenv.SEED`) where Kiln's interpreter has it. It answers None, saying why,
where one is missing, at another version, installed editable, or not described file by file by its
``RECORD``; the base is then made by pip as before.

:func:`copy_into` then fills a new environment's site-packages with *copies* of exactly the files those
distributions' ``RECORD`` lists under site-packages (their modules, compiled ``.pyc`` files, dist-infos),
modification times kept so the ``.pyc`` files stay valid. Nothing else of Kiln's site-packages (Kiln, Prefect,
an editable install's ``.pth``) is copied, and nothing is shared with it: no link, so the base's
read-only modes and any in-place edit never reach Kiln's environment (a hard link would share the inode).
Scripts and data a ``RECORD`` lists outside site-packages (``../../../bin/torchrun``) are left out: a
suite's environment reaches the base only through its site-packages.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.tasks.build.buildenv import SEED
from kiln.tasks.project.config_project import pinned_version

log = logging.getLogger(__name__)

COPY_THREADS = 4  # copies are the kernel's (sendfile): threads overlap their waits on the disk


@dataclass(frozen=True)
class HostDistributions:
    """What a base copied from Kiln's interpreter holds: every distribution's files, and its pins."""

    site: Path  # Kiln's interpreter's site-packages, where every file below lies
    files: tuple[str, ...]  # paths relative to ``site``, from the distributions' RECORDs
    pins: tuple[str, ...]  # name==version of each distribution, sorted by name

    def __len__(self) -> int:
        return len(self.pins)


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _installed(site: Path) -> dict[str, metadata.Distribution]:
    """The distributions installed in ``site`` by canonical name (the first found, as importlib finds it)."""
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=[str(site)]):
        found.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist)
    return found


def _editable(dist: metadata.Distribution) -> bool:
    """Installed editable (PEP 660, ``direct_url.json``): its files are a checkout's, not a RECORD's."""
    try:
        found = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return True  # unreadable: not trusted to be a plain install
    return bool(isinstance(found, dict) and isinstance(found.get("dir_info"), dict)
                and found["dir_info"].get("editable"))


def host_distributions(pins: Sequence[str], site: Path | None = None) -> HostDistributions | None:
    """The distributions of ``site`` (Kiln's interpreter's) a base of ``pins`` would hold, or None, logged why.

    ``pins`` are ``name==version`` (:func:`~kiln.tasks.testing.baseenv.base_pins`).
    """
    site = site or _site()
    installed = _installed(site)
    wanted: list[tuple[str, Requirement | None]] = []
    for text in pins:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            return _no(f"{text!r} is not a requirement")
        version = pinned_version([text], canonicalize_name(req.name))
        dist = installed.get(canonicalize_name(req.name))
        if version is None or dist is None or not _same_version(dist.version, version):
            found = f"{dist.version}" if dist is not None else "not installed"
            return _no(f"{text} is not what Kiln's interpreter has ({req.name}: {found})")
        wanted.append((canonicalize_name(req.name), None))
    wanted += [(name, None) for name in SEED if name in installed]  # what pip --upgrade seeds the pip-made base with
    chosen: dict[str, metadata.Distribution] = {}
    while wanted:
        name, needed = wanted.pop()
        dist = installed.get(name)
        if dist is None or (needed is not None and needed.specifier and
                            not needed.specifier.contains(dist.version, prereleases=True)):
            return _no(f"{needed or name} (required by the base) is "
                       f"{'at ' + dist.version if dist else 'not installed'} here")
        if name in chosen:
            continue
        chosen[name] = dist
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                wanted.append((canonicalize_name(dep.name), dep))
    files: list[str] = []
    for name, dist in sorted(chosen.items()):
        if _editable(dist) or not dist.files:
            return _no(f"{name} {dist.version} is installed {'editable' if dist.files else 'without a RECORD'}")
        for entry in dist.files:
            rel = os.path.normpath(str(entry))
            if os.path.isabs(rel) or rel == ".." or rel.startswith(".." + os.sep):
                continue  # a script or data file outside site-packages
            if not (site / rel).is_file():
                return _no(f"{name} {dist.version}: {rel}, listed in its RECORD, is missing from {site}")
            files.append(rel)
    return HostDistributions(site, tuple(dict.fromkeys(files)),
                             tuple(f"{name}=={dist.version}" for name, dist in sorted(chosen.items())))


def _same_version(found: str, pinned: str) -> bool:
    try:
        return Version(found) == Version(pinned) and Version(found).local == Version(pinned).local
    except InvalidVersion:
        return found == pinned


def _no(why: str) -> HostDistributions | None:
    log.info("the test base cannot be copied from Kiln's interpreter (%s): pip makes it", why)
    return None


def copy_into(target_site: Path, host: HostDistributions) -> None:
    """Copy every file of ``host`` into ``target_site`` (an empty site-packages), times kept."""
    for parent in sorted({os.path.dirname(rel) for rel in host.files} - {""}):
        (target_site / parent).mkdir(parents=True, exist_ok=True)

    def copy(rel: str) -> None:
        shutil.copy2(host.site / rel, target_site / rel, follow_symlinks=True)

    with ThreadPoolExecutor(COPY_THREADS) as pool:
        for _ in pool.map(copy, host.files):  # the first failure is raised here
            pass
