"""Check a published index from the outside, as pip and uv will see it.

:func:`verify_index` fetches the root and every project page in both
formats (HTML, and JSON through the ``Accept`` header), checks that both list
the same files, that every link resolves with the advertised SHA-256 and
size, and that every advertised metadata sidecar exists with its hash. Then it
installs the newest version of each project with pip and with uv into fresh
virtual environments from that URL, and imports it.

Kernel wheels import torch; a fresh venv would have to download gigabytes
that are not under test. With ``inherit_site_packages`` the venv sees this
interpreter's site-packages through a ``.pth`` file appended after its own,
and the wheel is installed with ``--no-deps``, so the import still proves the
wheel from the index is the one that loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from packaging.utils import canonicalize_name
from packaging.version import Version

from release.dists import parse_filename
from release.errors import IntegrityError
from release.fsutil import sha256_bytes
from release.index import JSON_TYPE
from release.serve import IndexServer
from release.store import open_store

log = logging.getLogger("kiln.verify")

HTML_ACCEPT = "text/html"
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class VerifyReport:
    url: str
    pages: int = 0
    files: int = 0
    problems: list[str] = field(default_factory=list)
    installs: dict[str, str] = field(default_factory=dict)  # "pip kiln-kernels==0.1.0" -> "ok" | error

    @property
    def ok(self) -> bool:
        return not self.problems and all(v == "ok" for v in self.installs.values())

    def summary(self) -> str:
        state = "OK" if self.ok else "FAILED"
        lines = [f"{state}: {self.url}: {self.pages} pages, {self.files} files, {len(self.problems)} problems"]
        lines += [f"  problem: {p}" for p in self.problems[:50]]
        lines += [f"  install {k}: {v}" for k, v in sorted(self.installs.items())]
        return "\n".join(lines)


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.anchors.append(dict(attrs))


def _fetch(url: str, timeout: float, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) URLs from the caller
        return response.read()


def _page(url: str, timeout: float, report: VerifyReport) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(HTML anchors, JSON document) of one page, or None after recording why not."""
    try:
        html, data = _fetch(url, timeout, HTML_ACCEPT), json.loads(_fetch(url, timeout, JSON_TYPE))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        report.problems.append(f"{url}: cannot fetch or parse the page: {exc}")
        return None
    parser = _Anchors()
    parser.feed(html.decode("utf-8"))
    report.pages += 2
    return parser.anchors, data


def _check_file(page_url: str, entry: dict[str, Any], anchor: dict[str, Any], timeout: float, report: VerifyReport) -> None:
    name = entry["filename"]
    href, fragment = urldefrag(anchor.get("href") or "")
    if "+" in href:
        report.problems.append(f"{page_url}: link {href!r} has a raw '+' (must be %2B)")
    if fragment != f"sha256={entry['hashes']['sha256']}":
        report.problems.append(f"{page_url}: {name}: HTML fragment {fragment!r} differs from the JSON hash")
    try:
        data = _fetch(urljoin(page_url, entry["url"]), timeout)
    except (urllib.error.URLError, OSError) as exc:
        report.problems.append(f"{page_url}: {name} does not resolve: {exc}")
        return
    report.files += 1
    if sha256_bytes(data) != entry["hashes"]["sha256"] or len(data) != entry.get("size", len(data)):
        report.problems.append(f"{page_url}: {name}: sha256 or size does not match the page")
    metadata = entry.get("core-metadata")
    advertised = (anchor.get("data-core-metadata"), anchor.get("data-dist-info-metadata"))
    if isinstance(metadata, dict):
        if advertised != (f"sha256={metadata['sha256']}",) * 2:
            report.problems.append(f"{page_url}: {name}: HTML sidecar attributes {advertised} differ from the JSON")
        try:
            sidecar = _fetch(urljoin(page_url, entry["url"]) + ".metadata", timeout)
        except (urllib.error.URLError, OSError) as exc:
            report.problems.append(f"{page_url}: {name}.metadata is advertised but does not resolve: {exc}")
            return
        if sha256_bytes(sidecar) != metadata["sha256"]:
            report.problems.append(f"{page_url}: {name}.metadata does not match its advertised sha256")


def check_links(url: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[VerifyReport, dict[str, str]]:
    """Check every page and link; returns the report and the newest installable version per project."""
    url = url if url.endswith("/") else url + "/"
    report, newest = VerifyReport(url), {}
    root = _page(url, timeout, report)
    if root is None:
        return report, newest
    anchors, data = root
    html_names = sorted(canonicalize_name(unquote(a.get("href") or "").strip("/")) for a in anchors)
    names = sorted(p["name"] for p in data.get("projects", []))
    if html_names != names:
        report.problems.append(f"{url}: HTML lists {html_names}, JSON lists {names}")
    for name in names:
        page_url = urljoin(url, f"{name}/")
        page = _page(page_url, timeout, report)
        if page is None:
            continue
        by_name = {unquote(urldefrag(a.get("href") or "")[0]): a for a in page[0]}
        files = page[1].get("files", [])
        if sorted(by_name) != sorted(f["filename"] for f in files):
            report.problems.append(f"{page_url}: HTML and JSON list different files")
        for entry in files:
            _check_file(page_url, entry, by_name.get(entry["filename"], {}), timeout, report)
        wheels = [f["filename"] for f in files if f["filename"].endswith(".whl") and not f.get("yanked")]
        if wheels:
            newest[name] = str(max((Version(parse_filename(w)[1]) for w in wheels)))
    return report, newest


def _run(cmd: list[str], timeout: float, what: str) -> str:
    log.info("running %s", " ".join(cmd))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"{what}: timed out after {timeout:.0f} s"
    if done.returncode != 0:
        return f"{what}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-1500:]}"
    return "ok"


def _uv() -> list[str]:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "uv"]


def _install_one(tool: str, url: str, requirement: str, module: str, workdir: Path, timeout: float,
                 no_deps: bool, inherit: bool) -> str:
    venv = workdir / f"{tool}-venv"
    create = [sys.executable, "-m", "venv", str(venv)] if tool == "pip" else [*_uv(), "venv", "--python", sys.executable, str(venv)]
    result = _run(create, timeout, f"{tool}: create venv")
    if result != "ok":
        return result
    python = venv / "bin" / "python"
    if inherit:
        query = [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        log.info("running %s", " ".join(query))
        try:
            purelib = subprocess.run(query, capture_output=True, text=True, timeout=timeout, check=True).stdout.strip()
        except (subprocess.SubprocessError, OSError) as exc:
            return f"{tool}: cannot locate the fresh venv's site-packages: {exc}"
        # after the venv's own site-packages, so the wheel installed from the index wins
        Path(purelib, "zz_kiln_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    flags = ["--no-deps"] if no_deps else []
    install = ([str(python), "-m", "pip", "install", "--no-cache-dir", "--index-url", url, *flags, requirement]
               if tool == "pip" else
               [*_uv(), "pip", "install", "--no-cache", "--python", str(python), "--index-url", url, *flags, requirement])
    result = _run(install, timeout, f"{tool}: install {requirement}")
    if result != "ok":
        return result
    check = f"import {module}, sys; sys.exit(0 if {module}.__file__.startswith({str(venv)!r}) else 3)"
    return _run([str(python), "-c", check], timeout, f"{tool}: import {module} from the fresh venv")


def verify_index(url: str, install: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
                 import_names: dict[str, str] | None = None, no_deps: bool = True,
                 inherit_site_packages: bool = True, tools: tuple[str, ...] = ("pip", "uv")) -> VerifyReport:
    """Check every page, link, hash and sidecar at ``url``; then install and import (see module docs).

    ``import_names`` maps a normalised project name to its import module
    (default: the name with ``-`` as ``_``).
    """
    report, newest = check_links(url, timeout)
    if not install or report.problems:
        return report
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        for project, version in sorted(newest.items()):
            module = (import_names or {}).get(project, project.replace("-", "_"))
            for tool in tools:
                requirement = f"{project}=={version}"
                workdir = Path(tmp) / f"{project}-{tool}"
                workdir.mkdir()
                report.installs[f"{tool} {requirement}"] = _install_one(
                    tool, report.url, requirement, module, workdir, timeout, no_deps, inherit_site_packages)
    return report


def verify_published(config: Any, out: str, channel: str, session: Any = None, install: bool = True) -> list[VerifyReport]:
    """Verify every variant index of ``channel`` on the default target; IntegrityError if any check fails."""
    spec = config.publish.targets[config.publish.default_target]
    store = open_store(spec.url.replace("{out}", str(Path(out).resolve())), root=config.root, region=spec.region,
                       endpoint=spec.endpoint, expected_owner=spec.expected_owner, session=session)
    prefix = dict(config.publish.channels)[channel].strip("/")
    names = {canonicalize_name(config.project.distribution): config.project.package}
    reports = []
    with IndexServer(store, prefix) as server:
        for variant in config.variants:
            if store.get(f"{prefix}/{variant.name}/simple/index.json") is None:
                continue
            reports.append(verify_index(f"{server.url}{variant.name}/simple/", install=install, import_names=names))
    failed = [r for r in reports if not r.ok]
    if failed:
        raise IntegrityError("index verification failed:\n" + "\n".join(r.summary() for r in failed))
    return reports
