"""Dependency closure: would pip install a variant's wheel from what this publish stages, with its real indexes?

Before anything of a publish is uploaded (so before any per-commit index or
channel page can change), each variant's wheel is offered to pip's resolver
as its users will meet it: a local index holding exactly what the publish
puts in that variant's index (the wheel, ``kiln-runtime``, pins; pages and
PEP 658 sidecars as Kiln writes them, so pip reads metadata and never a
whole wheel) first, and the project's ``[publish] extra_index_urls`` for the
rest — ``pip install --dry-run --ignore-installed --report`` of the wheel's
exact ``name==version`` in an isolated pip (no configuration file, no
environment variables). A wheel whose dependencies do not resolve is refused,
naming the requirement pip could not find.

The question depends on the wheel's requirements, not on its version, so
:attr:`ClosureQuery.cache_key` leaves the version out: the publish flow runs
the check as a Prefect task cached on that key for a while (nightly after
nightly asks the same question).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from kiln.release.dists import Distribution
from kiln.release.errors import InfrastructureError
from kiln.release.index import generate
from kiln.release.wheels import core_metadata

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 600.0  # pip reads every dependency's page and metadata from the extra indexes
PARALLEL = 4  # variants resolved at once
MAX_CAUSES = 3  # of the conflicting pins pip lists (one per candidate version it tried)
_NOT_FOUND = re.compile(r"No matching distribution found for (.+)")
_NO_VERSION = re.compile(r"Could not find a version that satisfies the requirement (\S+)")


@dataclass(frozen=True)
class Staged:
    """One file the publish puts in the variant's index."""

    dist: Distribution
    source: Path


@dataclass(frozen=True)
class ClosureQuery:
    """Would ``wheel`` install, with its dependencies, from ``beside`` plus ``extra_index_urls``?"""

    variant: str
    wheel: Staged
    beside: tuple[Staged, ...]  # the rest of the variant's index: kiln-runtime, pins
    extra_index_urls: tuple[str, ...]

    @property
    def requirement(self) -> str:
        return f"{self.wheel.dist.project}=={self.wheel.dist.version}"

    @property
    def cache_key(self) -> str:
        """What the answer depends on: the wheel's declared requirements, the staged files, the indexes."""
        metadata = BytesParser().parsebytes(core_metadata(self.wheel.dist.filename, self.wheel.source),
                                            headersonly=True)
        facts = {"requires": sorted(metadata.get_all("Requires-Dist") or []),
                 "python": metadata.get("Requires-Python") or "", "tags": self.wheel.dist.filename.split("-")[-3:],
                 "beside": sorted(s.dist.sha256 for s in self.beside), "indexes": list(self.extra_index_urls),
                 "interpreter": sys.version_info[:2]}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ClosureResult:
    ok: bool
    missing: str = ""  # the requirement pip could not satisfy, as pip names it
    detail: str = ""  # pip's last lines, or what resolved

    def describe(self, query: ClosureQuery) -> str:
        if self.ok:
            return f"{query.requirement} resolves from the staged index and {list(query.extra_index_urls)}"
        what = f"its dependency {self.missing} is on no index" if self.missing else "its dependencies do not resolve"
        return (f"{query.requirement} would not install: {what} (pip, from the staged {query.variant} index and "
                f"{list(query.extra_index_urls) or 'no other index'}): {self.detail}")


def stage_index(files: Sequence[Staged], directory: Path) -> str:
    """A local index of ``files`` under ``directory`` (links to the files, real sidecars); its file:// URL."""
    root = directory / "simple"
    for path, data in generate([s.dist for s in files]).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    for item in files:
        target = root / item.dist.project / item.dist.filename
        os.symlink(Path(item.source).resolve(), target)
        target.with_name(target.name + ".metadata").write_bytes(core_metadata(item.dist.filename, item.source))
    return root.as_uri() + "/"


def resolve(query: ClosureQuery, timeout: float = RESOLVE_TIMEOUT_S) -> ClosureResult:
    """Ask pip's resolver; what it says, with the missing requirement when it names one."""
    with tempfile.TemporaryDirectory(prefix="kiln-closure-") as tmp:
        index = stage_index([query.wheel, *query.beside], Path(tmp))
        report = Path(tmp) / "report.json"
        extras = [flag for url in query.extra_index_urls for flag in ("--extra-index-url", url)]
        # fast-deps: each wheel's metadata by HTTP range requests where the index serves no PEP 658 sidecar,
        # never the whole wheel (a CUDA torch's closure is gigabytes); pip >= 25.3 keeps a dry run at that.
        cmd = [sys.executable, "-I", "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
               "--use-feature=fast-deps", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
               "--report", str(report), "--index-url", index, *extras, query.requirement]
        log.info("resolving %s: %s", query.requirement, " ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise InfrastructureError(f"pip did not finish resolving {query.requirement} in {timeout:.0f} s") from exc
        if done.returncode == 0:
            installs = json.loads(report.read_text()).get("install", [])
            return ClosureResult(True, "", f"{len(installs)} distributions")
        return read_refusal(query, done.stdout + "\n" + done.stderr)


def read_refusal(query: ClosureQuery, text: str) -> ClosureResult:
    """pip's refusal: the requirement no index has, or the conflicting pins pip lists.

    Anything else (a full disk, an index that did not answer) is no answer about the dependencies:
    an :class:`InfrastructureError`, which the publish flow's task retries.
    """
    found = _NOT_FOUND.search(text) or _NO_VERSION.search(text)
    conflict = text.split("The conflict is caused by:", 1)[1].strip().split("\n\n", 1)[0] \
        if "The conflict is caused by:" in text else ""
    if conflict:
        causes = list(dict.fromkeys(line.strip() for line in conflict.splitlines() if line.strip()))
        more = f"; and {len(causes) - MAX_CAUSES} more" if len(causes) > MAX_CAUSES else ""
        return ClosureResult(False, "", f"conflicting pins: {'; '.join(causes[:MAX_CAUSES])}{more}")
    errors = " ".join(line.strip() for line in text.splitlines() if line.startswith("ERROR:"))[-800:]
    if found is None and "ResolutionImpossible" not in text:
        raise InfrastructureError(f"pip could not check {query.requirement}: {errors or text.strip()[-800:]}")
    return ClosureResult(False, found.group(1).strip() if found else "", errors)


def resolve_all(queries: Sequence[ClosureQuery], timeout: float = RESOLVE_TIMEOUT_S) -> list[ClosureResult]:
    """:func:`resolve` for every query at once (pip mostly waits on the indexes), answers in order."""
    if not queries:
        return []
    def answer(query: ClosureQuery) -> ClosureResult:
        try:
            return resolve(query, timeout)
        except InfrastructureError as exc:  # no answer is not a yes: the variant is not shown to install
            return ClosureResult(False, "", f"the check did not run to an answer: {exc}")

    with ThreadPoolExecutor(max_workers=min(len(queries), PARALLEL)) as pool:
        return list(pool.map(answer, queries))


__all__ = ["ClosureQuery", "ClosureResult", "RESOLVE_TIMEOUT_S", "Staged", "read_refusal", "resolve", "resolve_all",
           "stage_index"]
