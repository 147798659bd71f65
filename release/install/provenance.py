"""Where a resolution takes each file from: a name a Kiln index holds comes from that index, or it is refused.

pip's ``--report`` names every distribution it would install with the URL of
the file it chose and that file's hash. A name the Kiln index holds (the
project, ``kiln-runtime``, pins) is Kiln's when the file's SHA-256 is one the
Kiln index lists for it; any other file of that name — a higher version, a
same-version wheel with a more specific tag, a file without a hash — came from
another index and is the dependency-confusion attack (PEP 708's problem). The
comparison is by content, so it holds whatever URL form an index links with.

:func:`sdist_only` reads pip's verbose log of a wheels-only resolution
(``--only-binary :all:``, logged at ``-vv``): the projects it skipped an sdist of, which it would
otherwise have built (and run the build hook of) to read metadata.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packaging.utils import canonicalize_name

from kiln.core.errors import InvalidInputError
from kiln.core.installenv import run_installer
from kiln.release.install.installer import index_options

_MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9][A-Za-z0-9._-]*)")
_NO_SOURCE = re.compile(r"Skipping link: No (?:sources|binaries) permitted for ([A-Za-z0-9._-]+)")


@dataclass(frozen=True)
class Chosen:
    """One distribution a resolution installs: its name, version, file URL and SHA-256 (empty when unstated)."""

    name: str
    version: str
    url: str
    sha256: str


def read_report(path: Path) -> list[Chosen]:
    """The ``install`` entries of a pip ``--report`` file; InvalidInputError naming it when it is not one."""
    try:
        data = json.loads(path.read_text())
        return [_chosen(item) for item in data.get("install", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidInputError(f"pip's report {path} is not a pip installation report: {exc}") from exc


def _chosen(item: dict[str, Any]) -> Chosen:
    info = item.get("download_info") or {}
    archive = info.get("archive_info") or {}
    hashes = archive.get("hashes") or {}
    sha = hashes.get("sha256") or str(archive.get("hash") or "").removeprefix("sha256=")
    meta = item["metadata"]
    return Chosen(canonicalize_name(meta["name"]), str(meta["version"]), str(info.get("url", "")), sha)


def _index_of(url: str, indexes: Sequence[str]) -> str:
    """The index ``url`` was offered by, as well as its address tells: the one under which it lies, or on its host."""
    under = [index for index in indexes if url.startswith(index.rstrip("/") + "/")]
    if under:
        return under[0]
    host = urlsplit(url)[:2]
    same = [index for index in indexes if urlsplit(index)[:2] == host]
    return same[0] if len(same) == 1 else "an index other than the Kiln index"


def foreign(chosen: Sequence[Chosen], kiln_index: str, kiln_files: Mapping[str, frozenset[str]],
            indexes: Sequence[str]) -> list[str]:
    """Each held name (a key of ``kiln_files``: project -> the SHA-256 of its files there) the resolution
    takes from anywhere but ``kiln_index``: what, which file, from which of ``indexes``."""
    problems = []
    for item in chosen:
        held = kiln_files.get(item.name)
        if held is not None and item.sha256 not in held:
            problems.append(f"{item.name} {item.version} would come from {item.url} ({_index_of(item.url, indexes)})"
                            f", not from the Kiln index {kiln_index}, which holds {item.name}: another index "
                            "shadows it (dependency confusion); a name the Kiln index holds must install from it only")
    return problems


@dataclass(frozen=True)
class Resolution:
    """What one wheels-only ``pip install --dry-run --report`` said."""

    returncode: int
    chosen: tuple[Chosen, ...]  # empty unless it resolved
    output: str  # stdout and stderr
    sdists: tuple[str, ...]  # projects of which it skipped an sdist (it would otherwise have built it)


def pip_dry_run(python: Sequence[str], options: Sequence[str], requirements: Sequence[str], cwd: Path,
                timeout: float, extra_env: Mapping[str, str] | None = None) -> Resolution:
    """Resolve ``requirements`` with pip in ``python`` and ``options``: wheels only, nothing installed, in the
    scrubbed environment (and ``extra_env``); :class:`subprocess.TimeoutExpired` past ``timeout``.

    When pip finds no distribution for a requirement, the one project it names is asked again alone
    (``--no-deps``, ``-vv``), to learn whether the indexes hold only an sdist of it: pip says so only in its
    debug log, which for a whole resolution is megabytes and half again its time.
    """
    report = Path(cwd) / "pip-report.json"
    report.unlink(missing_ok=True)
    pip = [*python, "-m", "pip", "install", "--dry-run", "--only-binary", ":all:", "--progress-bar", "off"]
    done = run_installer([*pip, "--report", str(report), *options, *requirements], Path(cwd), timeout, extra_env)
    output = done.stdout + "\n" + done.stderr
    if done.returncode == 0:
        return Resolution(0, tuple(read_report(report)), output, ())
    missing = _MISSING.search(output)
    if missing is None:
        return Resolution(done.returncode, (), output, ())
    probe = run_installer([*pip, "-vv", "--no-deps", *options, missing.group(1)], Path(cwd), timeout, extra_env)
    return Resolution(done.returncode, (), output, tuple(sdist_only(probe.stdout + "\n" + probe.stderr)))


def shadowed(index_url: str, versions: Mapping[str, str], held: Mapping[str, frozenset[str]],
             extra_index_urls: Sequence[str], timeout: float, workdir: Path) -> list[str]:
    """Resolve each ``project==version`` as one plain ``pip install --index-url … --extra-index-url …`` would
    (wheels only, nothing installed): each held name another index would win, naming the file and that index;
    a project that does not resolve, naming the sdist-only dependency where that is why."""
    problems = []
    for project, version in sorted(versions.items()):
        what = f"{project}=={version}"
        # fast-deps: metadata by range requests where an index serves no PEP 658 sidecar, never a whole wheel
        options = ["--isolated", "--ignore-installed", "--no-cache-dir", "--use-feature=fast-deps",
                   *index_options("pip", index_url, extra_index_urls)]
        try:
            done = pip_dry_run([sys.executable, "-I"], options, [what], workdir, timeout)
        except (subprocess.TimeoutExpired, InvalidInputError) as exc:
            problems.append(f"{what}: resolving it from {index_url} and {list(extra_index_urls)} did not finish: {exc}")
            continue
        if done.returncode != 0:
            sdists = f"; the indexes hold only an sdist of {', '.join(done.sdists)} (not built: wheels only)" \
                if done.sdists else ""
            errors = " ".join(line.strip() for line in done.output.splitlines() if line.startswith("ERROR:"))
            problems.append(f"{what} does not resolve from {index_url} and {list(extra_index_urls)}{sdists}: "
                            f"{errors[-800:]}")
            continue
        problems += [f"{what}: {problem}"
                     for problem in foreign(done.chosen, index_url, held, [index_url, *extra_index_urls])]
    return problems


def sdist_only(log_text: str) -> list[str]:
    """The projects pip skipped an sdist of in a wheels-only resolution (its ``-vv`` log), in order."""
    return list(dict.fromkeys(canonicalize_name(m.group(1)) for m in _NO_SOURCE.finditer(log_text)))


__all__ = ["Chosen", "Resolution", "foreign", "pip_dry_run", "read_report", "sdist_only", "shadowed"]
