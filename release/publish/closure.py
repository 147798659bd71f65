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

Nothing from an extra index runs while checking: pip reads wheels only
(``--only-binary :all:``; a dependency of which the indexes hold only an
sdist is reported as such, never built) in the scrubbed environment of
:mod:`kiln.core.installenv`. And a name the staged index holds (the
project, ``kiln-runtime``, pins) must resolve to one of its files: when pip's
report takes it from another index (a higher version, a same-version wheel
with a more specific tag) the check refuses, naming the file and the index
(:mod:`kiln.release.install.provenance`).

The question depends on the wheel's requirements, not on its version, so
:attr:`ClosureQuery.cache_key` leaves the version out: the publish flow runs
the check as a Prefect task cached on that key for a while (nightly after
nightly asks the same question).

A nightly asks its questions early: :func:`prefetch` starts them on daemon threads as soon as its wheels
are built, and the publish stage's :func:`resolve_shared` takes each answer (waiting for one still in
flight) instead of starting a second pip. Only an answer is shared, used once, in this process; a check
that raised is forgotten, so the publish stage resolves again and meets the real error itself.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import BytesParser
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from kiln.core.dists import Distribution
from kiln.core.errors import InfrastructureError, InvalidInputError
from kiln.core.wheels import core_metadata
from kiln.release.index.render import generate
from kiln.release.install.provenance import foreign, pip_dry_run

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 600.0  # pip reads every dependency's page and metadata from the extra indexes
PARALLEL = 4  # variants resolved at once
CHECK_REVISION = 2  # in the cache key: an answer of an older check (which built sdists, took any index) is not kept
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
                 "interpreter": sys.version_info[:2], "check": CHECK_REVISION}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ClosureResult:
    ok: bool
    missing: str = ""  # the requirement pip could not satisfy, as pip names it
    detail: str = ""  # pip's last lines, or what resolved
    shadowed: bool = False  # it resolves, but takes a name the staged index holds from another index

    def describe(self, query: ClosureQuery) -> str:
        if self.ok:
            return f"{query.requirement} resolves from the staged index and {list(query.extra_index_urls)}"
        what = f"its dependency {self.missing} is on no index" if self.missing else "its dependencies do not resolve"
        if self.shadowed:
            what = "another index shadows a name the Kiln index holds"
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


def target_python(filename: str) -> list[str]:
    """pip's ``--python-version`` for a wheel this interpreter cannot install: a matrix cell's (``cp312``) is
    checked as its own Python would install it; none for a wheel this interpreter takes (``py3``, its own tag).
    A wheel for another CPU (an aarch64 cell's, cross-built here) is checked as that CPU would install it
    (``--platform``, each of its platform tags)."""
    tags = parse_wheel_filename(filename)[3]
    here = set(sys_tags())
    if not tags.isdisjoint(here):
        return []
    found = sorted({t.interpreter[2:] for t in tags if re.fullmatch(r"cp3\d+", t.interpreter)})
    options = ["--python-version", f"3.{found[0][1:]}"] if found else []
    platforms = {t.platform for t in tags}
    if "any" not in platforms and platforms.isdisjoint({t.platform for t in here}):
        options += [flag for platform in sorted(platforms) for flag in ("--platform", platform)]
    return options


def kiln_files(query: ClosureQuery) -> dict[str, frozenset[str]]:
    """Every name the staged index holds, with the SHA-256 of its files there: what must come from it alone."""
    found: dict[str, set[str]] = {}
    for item in (query.wheel, *query.beside):
        found.setdefault(item.dist.project, set()).add(item.dist.sha256)
    return {name: frozenset(hashes) for name, hashes in found.items()}


def pip_cache_dir() -> Path:
    """pip's HTTP cache for the checks (index pages and metadata, never code that runs): owner-only, Kiln's own,
    so the checks' answers from the extra indexes are not fetched twice although every check gets a fresh HOME."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "closure-pip"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def resolve(query: ClosureQuery, timeout: float = RESOLVE_TIMEOUT_S) -> ClosureResult:
    """Ask pip's resolver (wheels only, scrubbed environment); what it says, with the missing requirement
    when it names one, and a refusal naming the file and index when a held name would come from elsewhere."""
    with tempfile.TemporaryDirectory(prefix="kiln-closure-") as tmp:
        index = stage_index([query.wheel, *query.beside], Path(tmp))
        extras = [flag for url in query.extra_index_urls for flag in ("--extra-index-url", url)]
        # fast-deps: each wheel's metadata by HTTP range requests where the index serves no PEP 658 sidecar,
        # never the whole wheel (a CUDA torch's closure is gigabytes); pip >= 25.3 keeps a dry run at that.
        options = ["--isolated", "--ignore-installed", "--use-feature=fast-deps", "--cache-dir", str(pip_cache_dir()),
                   "--index-url", index, *extras, *target_python(query.wheel.dist.filename)]
        try:
            done = pip_dry_run([sys.executable, "-I"], options, [query.requirement], Path(tmp), timeout)
        except subprocess.TimeoutExpired as exc:
            raise InfrastructureError(f"pip did not finish resolving {query.requirement} in {timeout:.0f} s") from exc
        except InvalidInputError as exc:
            raise InfrastructureError(f"pip could not check {query.requirement}: {exc}") from exc
        if done.returncode != 0:
            return read_refusal(query, done.output, done.sdists)
        shadowed = foreign(done.chosen, f"the staged {query.variant} index", kiln_files(query),
                           [index, *query.extra_index_urls])
        if shadowed:
            return ClosureResult(False, "", "; ".join(shadowed), shadowed=True)
        return ClosureResult(True, "", f"{len(done.chosen)} distributions")


def read_refusal(query: ClosureQuery, text: str, sdists: Sequence[str] = ()) -> ClosureResult:
    """pip's refusal: the requirement no index has (said to have only an sdist when pip skipped one of it:
    ``sdists``, never built while checking), or the conflicting pins pip lists.

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
    missing = found.group(1).strip() if found else ""
    name = re.split(r"[\s<>=!~;\[(]", missing, maxsplit=1)[0]
    if name and canonicalize_name(name) in sdists:
        missing += " (the indexes hold only an sdist of it: not built while checking, wheels only)"
    return ClosureResult(False, missing, errors)


def unique_queries(queries: Sequence[ClosureQuery]) -> dict[str, ClosureQuery]:
    """The distinct questions among ``queries`` by :attr:`ClosureQuery.cache_key`, the first asker of each."""
    unique: dict[str, ClosureQuery] = {}
    for query in queries:
        unique.setdefault(query.cache_key, query)
    return unique


def resolve_all(queries: Sequence[ClosureQuery], timeout: float = RESOLVE_TIMEOUT_S) -> list[ClosureResult]:
    """:func:`resolve` for every distinct query at once (pip mostly waits on the indexes), answers in order."""
    if not queries:
        return []
    def answer(query: ClosureQuery) -> ClosureResult:
        try:
            return resolve(query, timeout)
        except InfrastructureError as exc:  # no answer is not a yes: the variant is not shown to install
            return ClosureResult(False, "", f"the check did not run to an answer: {exc}")

    unique = unique_queries(queries)
    with ThreadPoolExecutor(max_workers=min(len(unique), PARALLEL)) as pool:
        answers = dict(zip(unique, pool.map(answer, unique.values()), strict=True))
    return [answers[query.cache_key] for query in queries]


# The answers of checks started ahead of their asker, by cache key: in flight or done, each taken once.
_early: dict[str, Future[ClosureResult]] = {}
_early_lock = threading.Lock()
_early_slots = threading.BoundedSemaphore(PARALLEL)  # prefetched pips at once, however many prefetches


def prefetch(queries: Sequence[ClosureQuery]) -> None:
    """Start :func:`resolve` of every distinct query not already asked, on daemon threads (at most
    :data:`PARALLEL` pips at once; each has :func:`resolve`'s timeout), for :func:`resolve_shared` to take.

    Nothing waits for them but their asker (invariant 11): a cancelled ``kiln`` command ends their pips with
    the rest of what it ran in its own group (:mod:`kiln.tasks.descendants`), and a pip ended so raises, so its
    answer is forgotten."""
    for key, query in unique_queries(queries).items():
        future: Future[ClosureResult] = Future()
        with _early_lock:
            if key in _early:
                continue
            _early[key] = future
        # the caller's context (a flow run's): what pip runs is logged to that run
        threading.Thread(target=contextvars.copy_context().run, args=(_resolve_early, key, query, future),
                         name=f"kiln-closure-{query.variant}", daemon=True).start()


def _resolve_early(key: str, query: ClosureQuery, future: Future[ClosureResult]) -> None:
    with _early_slots:
        try:
            future.set_result(resolve(query))
        except BaseException as exc:  # forgotten, so its asker resolves again; never a waiter left waiting
            with _early_lock:
                if _early.get(key) is future:
                    del _early[key]
            log.info("the early dependency check of %s (%s) did not answer (%s); the publish stage asks again",
                     query.requirement, query.variant, exc)
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise


def resolve_shared(query: ClosureQuery) -> ClosureResult:
    """:func:`resolve`'s answer to ``query``: the one :func:`prefetch` started for its cache key when there is
    one (taken once; waiting while it runs), else a resolution of its own."""
    with _early_lock:
        future = _early.pop(query.cache_key, None)
    if future is not None:
        if not future.done():
            log.info("dependencies of %s (%s): waiting for the check started after the build",
                     query.requirement, query.variant)
        if future.exception() is None:  # one that raised was logged where it did: resolved again below
            log.info("dependencies of %s (%s) answered by the check started after the build",
                     query.requirement, query.variant)
            return future.result()
    return resolve(query)


__all__ = ["ClosureQuery", "ClosureResult", "RESOLVE_TIMEOUT_S", "Staged", "kiln_files", "prefetch", "read_refusal",
           "resolve", "resolve_all", "resolve_shared", "stage_index", "unique_queries"]
