"""Check a published index from the outside, as pip and uv will see it.

:func:`verify_index` reads the root and every project page in both forms
(PEP 503 HTML and PEP 691 JSON) through a source of
:mod:`kiln.release.read.fetch` — an HTTP server with or without content
negotiation, a ``file://`` directory, or an ``s3://`` prefix. It checks that
both forms list the same files with the same hashes and sidecars, that every
link resolves with the advertised SHA-256 (and size, which only the JSON form
states), and that every advertised metadata sidecar exists with its hash.
Every wheel's RECORD is checked against its members (hash and size of each).
Only links the index may serve are read — see :mod:`kiln.release.read.fetch`; a
refused link (another scheme, host or port; past its cap or deadline) is a
problem and is listed in :attr:`VerifyReport.refused`. Downloads stream to a
temporary file, one at a time, so a wheel is never held in memory.
A page without a JSON form (a static mirror of HTML only) is checked from its
HTML alone, and the report says so. On a page of PEP 825 variant wheels (a
channel's combined index, see :mod:`kiln.release.publish.protocol`) every variant
wheel's ``variant.json`` must be in its version's ``-variants.json`` as it is
(a missing or differently defined label is a problem).

Then it installs the newest version of each project with pip and with uv into
fresh virtual environments from that index, and imports it
(:mod:`kiln.release.install.installer`: wheels only, every name the index holds from it
alone). With extra indexes, each project is first resolved as one plain
``pip install --index-url … --extra-index-url …`` would, and a name this index
holds that another index would win fails the verification, naming the file
and the index (:func:`kiln.release.install.provenance.shadowed`); then dependencies
resolve from the extra indexes. Without any, the wheel goes in with
``--no-deps`` together with the dependencies this index holds
(``kiln-runtime``, pins), beside this interpreter's site-packages, and the
report says that the others were not resolved.

Each install hint the caller passes (``kiln verify --hint "pip install …"``,
the command a run printed) is then run as a user would
(:mod:`kiln.release.install.hintrun`: a fresh venv, ``-I``, an empty working
directory, timeouts, each step resolved first, with no pip configuration and
under the caller's own, and not run when it would take a name this index holds
from elsewhere, naming the configured index that would), and must install exactly the version
the index publishes of its project; an unpinned hint that takes a higher release from
an extra index fails the verification, naming both versions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from packaging.metadata import parse_email
from packaging.utils import canonicalize_name
from packaging.version import Version

from kiln.core.dists import VARIANTS_JSON_SUFFIX, parse_filename
from kiln.core.errors import FetchError, IntegrityError, InvalidInputError, LinkRefusedError, TooLargeError
from kiln.core.fsutil import sha256_bytes
from kiln.core.objects import Store
from kiln.core.store import is_remote
from kiln.core.wheels import core_metadata, import_names, member_limit, record_problems
from kiln.release.index.variants import VARIANT_JSON_LIMIT, merge_variants, read_wheel_variant, wheel_variant_label
from kiln.release.install.hintrun import Hint, check_hint, parse_hint
from kiln.release.install.installer import (
    TOOLS,
    InstallSpec,
    Tool,
    check_index_url,
    held_requirements,
    install_and_import,
)
from kiln.release.install.pipconfig import PipConfig, caller_pip_config
from kiln.release.install.provenance import shadowed
from kiln.release.publish.plan import COMBINED
from kiln.release.read.fetch import (
    FetchLimits,
    IndexSource,
    Page,
    StoreSettings,
    StoreSource,
    file_bytes,
    join,
    open_source,
)
from kiln.release.read.pageforms import FileRef, anchors, compare_forms, filename_of, html_files, json_files
from kiln.release.read.serve import IndexServer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
MAX_LISTED = 50


@dataclass
class VerifyReport:
    url: str
    pages: int = 0  # page forms read: 2 for a page with HTML and JSON, 1 for HTML alone
    files: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was checked differently, and why
    installs: dict[str, str] = field(default_factory=dict)  # "pip kiln-kernels==0.1.0" -> "ok" | error
    refused: list[str] = field(default_factory=list)  # links not fetched: off the index, or past their cap
    wheel_variants: bool = False  # the index lists PEP 825 variant wheels: uv installs with its preview

    @property
    def ok(self) -> bool:
        return not self.problems and all(v == "ok" for v in self.installs.values())

    def summary(self) -> str:
        state = "OK" if self.ok else "FAILED"
        lines = [f"{state}: {self.url}: {self.pages} pages, {self.files} files, {len(self.problems)} problems"]
        lines += [f"  problem: {p}" for p in self.problems[:MAX_LISTED]]
        lines += [f"  refused: {url}" for url in self.refused[:MAX_LISTED]]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  install {k}: {v}" for k, v in sorted(self.installs.items())]
        return "\n".join(lines)


class _Download:
    """A sink that hashes what it writes to a file, so a wheel is never held in memory whole."""

    def __init__(self, directory: Path) -> None:
        fd, name = tempfile.mkstemp(suffix=".part", dir=directory)
        self.path, self.digest, self.size = Path(name), hashlib.sha256(), 0
        self._handle = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self._handle.write(data)

    def close(self) -> None:
        self._handle.close()


def _fetch_problem(page_url: str, what: str, url: str, exc: FetchError, report: VerifyReport) -> None:
    """A download that failed: refused links (off the index, past a cap) are listed as such."""
    if isinstance(exc, (LinkRefusedError, TooLargeError)):
        report.refused.append(url)
        report.problems.append(f"{page_url}: {what} refused: {exc}")
    else:
        report.problems.append(f"{page_url}: {what} does not resolve: {exc}")


def _check_bytes(page_url: str, name: str, url: str, refs: list[FileRef], body: _Download,
                 report: VerifyReport) -> bool:
    """Whether ``body`` is what every ref advertises; each mismatch is a problem naming both hashes."""
    actual, size = body.digest.hexdigest(), body.size
    problems = len(report.problems)
    for ref in refs:
        if ref.sha256 is None:
            report.problems.append(f"{page_url}: {name}: the {ref.form} page gives no sha256 for it")
        elif ref.sha256 != actual or ref.size not in (None, size):
            declared = f" size={ref.size}" if ref.size is not None else ""
            report.problems.append(f"{page_url}: {name}: sha256 or size does not match the page: the {ref.form} page "
                                   f"says sha256={ref.sha256}{declared}, {url} has sha256={actual} size={size}")
    return len(report.problems) == problems


def _check_sidecar(page_url: str, name: str, url: str, refs: list[FileRef], source: IndexSource,
                   report: VerifyReport) -> None:
    advertised = [r for r in refs if r.metadata]
    if not advertised:
        return
    try:
        sidecar = file_bytes(source, url + ".metadata", member_limit("METADATA"))
    except FetchError as exc:
        _fetch_problem(page_url, f"{name}.metadata is advertised but", url + ".metadata", exc, report)
        return
    actual = f"sha256={sha256_bytes(sidecar)}"
    for ref in advertised:
        if ref.metadata not in ("true", actual):
            report.problems.append(f"{page_url}: {name}.metadata does not match its advertised sha256: the {ref.form} "
                                   f"page says {ref.metadata}, {url}.metadata has {actual}")


def _cap(refs: list[FileRef], source: IndexSource) -> int:
    """The most bytes read of a file: the size its page declares, never more than the configured maximum."""
    declared = [r.size for r in refs if isinstance(r.size, int) and not isinstance(r.size, bool) and r.size >= 0]
    return min([source.limits.max_file_bytes, *declared])


def _check_file(page_url: str, name: str, refs: list[FileRef], source: IndexSource, report: VerifyReport,
                workdir: Path) -> Path | None:
    """Check one file at every URL its refs name; a copy on disk of the last one that matched, if any."""
    found = None
    for url in sorted({r.url for r in refs}):
        at_url = [r for r in refs if r.url == url]
        body = _Download(workdir)
        try:
            source.download(url, body, _cap(at_url, source))
        except FetchError as exc:
            _fetch_problem(page_url, name, url, exc, report)
            body.path.unlink()
            continue
        finally:
            body.close()
        report.files += 1
        intact = _check_bytes(page_url, name, url, at_url, body, report)
        _check_sidecar(page_url, name, url, at_url, source, report)
        if intact:  # bytes other than the advertised ones are reported once, not read as a wheel too
            found = body.path
        else:
            body.path.unlink()
    return found


def _read(source: IndexSource, url: str, report: VerifyReport, html_only: list[str]) -> Page | None:
    try:
        page = source.page(url)
    except FetchError as exc:
        if isinstance(exc, (LinkRefusedError, TooLargeError)):
            report.refused.append(url)
        report.problems.append(f"{url}: cannot fetch or parse the page: {exc}")
        return None
    report.pages += 1 if page.json is None else 2
    if page.json is None:
        html_only.append(url)
    return page


@dataclass(frozen=True)
class Newest:
    """The newest installable version of a project, the modules its wheel makes importable and its
    ``Requires-Dist``; and the SHA-256 of every file the project's page lists (what is this index's)."""

    version: str
    modules: tuple[str, ...]
    requires: tuple[str, ...] = ()
    files: frozenset[str] = frozenset()


def _check_wheel(page_url: str, filename: str, path: Path,
                 report: VerifyReport) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """RECORD against the wheel's members (every lie is a problem); the modules the wheel makes importable,
    and its ``Requires-Dist``."""
    try:
        report.problems.extend(f"{page_url}: {problem}" for problem in record_problems(filename, path))
        raw, _ = parse_email(core_metadata(filename, path))
        return import_names(filename, path), tuple(str(r) for r in raw.get("requires_dist") or [])
    except InvalidInputError as exc:
        report.problems.append(f"{page_url}: {exc}")
        return (), ()


def _check_project(source: IndexSource, name: str, report: VerifyReport, html_only: list[str],
                   workdir: Path) -> Newest | None:
    """Check one project page and its files; the newest installable version, if any, and its import names."""
    page = _read(source, join(source.root, quote(name) + "/"), report, html_only)
    if page is None:
        return None
    html = html_files(page, report.problems)
    data = json_files(page, report.problems) if page.json is not None else {}
    if page.json is not None:
        compare_forms(page, html, data, report.problems)
    versions: dict[Version, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    hashes = frozenset(r.sha256 for refs in (html, data) for r in refs.values() if r.sha256)
    variants = _Variants()
    for filename in sorted(set(html) | set(data)):
        refs = [r for r in (html.get(filename), data.get(filename)) if r]
        body = _check_file(page.url, filename, refs, source, report, workdir)
        try:
            wheel = body is not None and filename.endswith(".whl")
            modules = _check_wheel(page.url, filename, body, report) if body and wheel else ((), ())
            if body is not None:
                variants.read(page.url, filename, body, report)
        finally:
            if body is not None:
                body.unlink()
        if filename.endswith(".whl") and not any(r.yanked for r in refs):
            try:
                version = Version(parse_filename(filename)[1])
            except InvalidInputError as exc:
                report.problems.append(f"{page.url}: {exc}")
                continue
            if not versions.get(version, ((), ()))[0]:  # the first of its wheels that makes a module importable
                versions[version] = modules
    variants.check(page.url, report)
    if not versions:
        return None
    newest = max(versions)
    return Newest(str(newest), versions[newest][0], versions[newest][1], hashes)


class _Variants:
    """A project page's PEP 825 variant wheels' ``variant.json`` and its variants files, by version."""

    def __init__(self) -> None:
        self.wheels: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.files: dict[str, tuple[str, Any]] = {}

    def read(self, page_url: str, filename: str, body: Path, report: VerifyReport) -> None:
        try:
            if filename.endswith(".whl") and wheel_variant_label(filename) is not None:
                version = parse_filename(filename)[1]
                self.wheels.setdefault(version, []).append((filename, read_wheel_variant(filename, body)))
            elif filename.endswith(VARIANTS_JSON_SUFFIX):
                if body.stat().st_size > VARIANT_JSON_LIMIT:
                    raise InvalidInputError(f"{filename} is larger than {VARIANT_JSON_LIMIT} bytes")
                self.files[parse_filename(filename)[1]] = (filename, json.loads(body.read_bytes()))
        except (InvalidInputError, ValueError) as exc:
            report.problems.append(f"{page_url}: {filename}: {exc}")

    def check(self, page_url: str, report: VerifyReport) -> None:
        """Every variant wheel's ``variant.json`` is in its version's variants file, label for label."""
        for version, wheels in sorted(self.wheels.items()):
            if version not in self.files:
                report.problems.append(f"{page_url}: lists variant wheels of {version} ({wheels[0][0]}…) but no "
                                       f"variants file of {version} (PEP 825)")
                continue
            name, published = self.files[version]
            try:
                merged = merge_variants(published, [document for _, document in wheels])
            except InvalidInputError as exc:
                report.problems.append(f"{page_url}: {name} does not match the variant wheels: {exc}")
                continue
            missing = sorted(set(merged["variants"]) - set(published.get("variants", {})))
            if missing:
                report.problems.append(f"{page_url}: {name} lacks the variant labels {missing} of its variant wheels")
        if self.wheels:
            report.wheel_variants = True
            report.notes.append(f"{page_url}: PEP 825 variant wheels, each checked against its version's variants "
                                "file; uv installs with its wheel-variants preview (the variant this machine "
                                "supports), pip takes the default wheel")


def _root_projects(source: IndexSource, report: VerifyReport, html_only: list[str]) -> list[str]:
    root = _read(source, source.root, report, html_only)
    if root is None:
        return []
    hrefs = [(a.get("href") or "").rstrip("/") for a in anchors(root)]
    html_names: list[str] = sorted({canonicalize_name(filename_of(href)) for href in hrefs if href})
    if root.json is None:
        return html_names
    projects = root.json.get("projects", []) if isinstance(root.json, dict) else []
    names = sorted(canonicalize_name(p["name"]) for p in projects if isinstance(p, dict) and "name" in p)
    if html_names != names:
        report.problems.append(f"{source.root}: HTML lists {html_names}, JSON ({root.json_url}) lists {names}")
    return sorted(set(html_names) | set(names))


def _notes(source: IndexSource, html_only: list[str], report: VerifyReport) -> None:
    if not source.negotiates:
        report.notes.append(f"{source.root}: the server does no PEP 691 content negotiation (a static server); "
                            "each page's JSON form was read from <page>/index.json")
    if html_only:
        listed = ", ".join(html_only[:5]) + (f" and {len(html_only) - 5} more" if len(html_only) > 5 else "")
        report.notes.append(f"{len(html_only)} page(s) have no PEP 691 JSON form; checked from their HTML alone: "
                            f"{listed}")


def check_source(source: IndexSource) -> tuple[VerifyReport, dict[str, Newest]]:
    """Check every page and link of ``source``; the report and the newest installable version per project."""
    report, newest, html_only = VerifyReport(source.root), dict[str, Newest](), list[str]()
    with tempfile.TemporaryDirectory(prefix="kiln-verify-files-") as workdir:  # one downloaded file at a time
        for name in _root_projects(source, report, html_only):
            found = _check_project(source, name, report, html_only, Path(workdir))
            if found is not None:
                newest[name] = found
    _notes(source, html_only, report)
    return report, newest


def check_links(url: str, timeout: float = DEFAULT_TIMEOUT_S, settings: StoreSettings | None = None,
                limits: FetchLimits | None = None) -> tuple[VerifyReport, dict[str, Newest]]:
    """:func:`check_source` on the source ``url`` names (http(s), file or s3)."""
    return check_source(open_source(url, timeout, settings, limits=limits))


@contextmanager
def _install_url(source: IndexSource, report: VerifyReport) -> Iterator[str]:
    """The URL pip and uv install from: the index itself, or Kiln's loopback server over an S3 store."""
    if isinstance(source, StoreSource) and is_remote(source.root):
        with IndexServer(source.store) as server:
            report.notes.append(f"pip and uv installed through Kiln's server on loopback over {source.store.url}")
            yield server.url + source.root[len(source.scope):]  # a per-commit index: its path below the scope
    else:
        yield source.root


def held_files(newest: Mapping[str, Newest]) -> dict[str, frozenset[str]]:
    """Every name the index holds, with the SHA-256 of its files there: what must install from it alone."""
    return {name: found.files for name, found in newest.items()}


def _install_all(source: IndexSource, newest: dict[str, Newest], report: VerifyReport,
                 extra_index_urls: tuple[str, ...], tools: Sequence[Tool], timeout: float) -> None:
    if extra_index_urls:
        report.notes.append(f"dependencies resolved from {', '.join(extra_index_urls)} (--extra-index-url), wheels "
                            "only; every name this index holds installed from it alone")
    else:
        report.notes.append("dependencies were not resolved (those this index holds were installed from it): "
                            "installed with --no-deps into venvs that see this interpreter's site-packages; pass "
                            "--extra-index-url URL (e.g. https://pypi.org/simple) to resolve them")
    with _install_url(source, report) as index_url, tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        if extra_index_urls:
            versions = {project: found.version for project, found in newest.items()}
            report.problems += shadowed(index_url, versions, held_files(newest), extra_index_urls, timeout, Path(tmp))
            if report.problems:
                return  # nothing is installed from indexes that shadow this one
        for project, found in sorted(newest.items()):
            if not found.modules:
                report.notes.append(f"{project} {found.version}: its wheel makes no module importable; installed only")
            spec = InstallSpec(index_url, f"{project}=={found.version}", found.modules, extra_index_urls,
                               wheel_variants=report.wheel_variants,
                               held=tuple(held_requirements(found.requires, newest)))
            for tool in tools:
                workdir = Path(tmp) / f"{project}-{tool}"
                workdir.mkdir()
                report.installs[f"{tool} {spec.requirement}"] = install_and_import(tool, spec, workdir, timeout)


def _run_hints(hints: Sequence[Hint], newest: dict[str, Newest], report: VerifyReport, timeout: float,
               caller: PipConfig, url: str) -> None:
    """Run each hint; it must install the newest version this index publishes of its project, every name this
    index holds from it (a step that would take one from another index is refused before it runs)."""
    for hint in hints:
        key = f"hint {hint.text}"
        published = newest.get(hint.project)
        if published is None:
            report.installs[key] = f"this index publishes no installable {hint.project}; the hint cannot install it"
            continue
        report.installs[key] = check_hint(hint, published.version, timeout, held_files(newest), caller, url)


def verify_index(url: str, install: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
                 extra_index_urls: Sequence[str] = (), tools: Sequence[Tool] = TOOLS,
                 settings: StoreSettings | None = None, limits: FetchLimits | None = None,
                 hints: Sequence[str] = (), caller: PipConfig | None = None) -> VerifyReport:
    """Check every page, link, hash and sidecar at ``url``; then install and import (see module docs).

    What is imported is what each wheel says it holds (``top_level.txt`` or
    its ``RECORD``), never a guess from the project's name. ``settings`` opens
    an ``s3://`` URL; ``limits`` caps every download (see :class:`~kiln.release.read.fetch.FetchLimits`).
    ``hints``: install commands to run as printed (see module docs), whatever ``install`` says; ``caller``:
    the pip configuration they are judged under besides none (default: this process's, as a shell here has it).
    """
    extras = tuple(check_index_url(extra) for extra in extra_index_urls)  # refused before anything is fetched
    parsed = [parse_hint(hint) for hint in hints]
    source = open_source(url, timeout, settings, allowed=extras, limits=limits)
    report, newest = check_source(source)
    if install and not report.problems:
        _install_all(source, newest, report, extras, tools, timeout)
    if not report.problems:
        found = caller_pip_config(os.environ, Path.home()) if caller is None else caller
        _run_hints(parsed, newest, report, timeout, found, url)
    return report


def verify_published(
    store: Store, prefix: str, variants: Sequence[str], install: bool = True
) -> list[VerifyReport]:
    """Verify every variant index and the combined index under ``prefix`` (a channel's) in ``store``;
    IntegrityError if any check fails.

    The caller opens the target (``kiln.tasks.releasing.open_target``, the one place a publish target is
    opened) and names the channel's prefix (``kiln.tasks.releasing.channel_prefix``)."""
    reports = []
    with IndexServer(store, prefix) as server:
        for variant in [*variants, COMBINED]:
            if store.get(f"{prefix}/{variant}/simple/index.json") is None:
                continue
            reports.append(verify_index(f"{server.url}{variant}/simple/", install=install))
    failed = [r for r in reports if not r.ok]
    if failed:
        raise IntegrityError("index verification failed:\n" + "\n".join(r.summary() for r in failed))
    return reports
