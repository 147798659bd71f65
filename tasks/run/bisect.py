"""``kiln bisect``: the first bad commit between a good and a bad one, from the wheels the runs stored.

Every run keeps its wheels in the artifact store (``runs/<id>/files/wheels/<variant>/…``) with the
commit it built, so a commit's wheel is installed, never rebuilt. A commit no run built is built
once in a ``git worktree`` of it, and its wheel kept under ``bisect-wheels/<commit>/<variant>/`` in
the same store for the next bisect. Each tried commit gets a fresh environment (the wheel, what it
declares, pytest: :func:`kiln.tasks.testing.envs.make_env`) and the test files of that commit.

Bisect installs and runs what it finds, so it trusts only bytes the build step vouched for: a stored or
kept wheel is used only when its sha256 is the one the build ledger (:mod:`kiln.tasks.run.ledger`, written
by the build step alone) holds for that commit; a run record or a ``.sha256`` beside a wheel vouches for
nothing, since other steps can write them. A wheel that contradicts the ledger, or one kept where bisect
keeps its builds that the ledger does not know, is refused (:class:`IntegrityError`) before anything is
installed. Bisect reads the store through a read-only wrapper (and read-only credentials on S3); only the
build step's own credentials keep what it builds.
"""

from __future__ import annotations

import logging
import subprocess
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import (
    IntegrityError,
    InvalidInputError,
    KilnError,
    PermanentError,
    ToolchainMissingError,
)
from kiln.core.fsutil import atomic_write_bytes, sha256_bytes
from kiln.core.objects import Store
from kiln.core.record import RunHeader, load_header, open_record
from kiln.tasks.run.ledger import record_wheel, recorded_sha256, vouched

log = logging.getLogger(__name__)

GIT_TIMEOUT_S = 120
BISECT_WHEELS = "bisect-wheels"
_JSON = "application/json"


@dataclass(frozen=True)
class Trial:
    """One commit tried: bad or not, why, and where its wheel came from."""

    commit: str
    bad: bool
    message: str
    wheel_from: str  # "run <id>", BUILT_NOW or BUILT_EARLIER


BUILT_NOW = "built now (no run stored its wheels)"
BUILT_EARLIER = "built earlier by bisect (no run stored its wheels)"


def git(root: Path, *args: str, error: type[KilnError] = InvalidInputError) -> str:
    """``git -C root ARGS``'s output; a failure is ``error`` (a ref git does not know: bad input) with git's words."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise ToolchainMissingError("git is not installed; bisect reads the commits between --good and --bad") from exc
    except subprocess.TimeoutExpired as exc:
        raise PermanentError(f"git {' '.join(args)} did not finish within {GIT_TIMEOUT_S} s in {root}") from exc
    if done.returncode != 0:
        raise error(f"git {' '.join(args)} failed in {root}: {done.stderr.strip()}")
    return done.stdout


def commit_range(root: Path, good: str, bad: str) -> tuple[str, list[str]]:
    """``good`` as a full sha, and the commits after it up to ``bad``, oldest first (``bad`` last).

    Refuses refs git does not know, and a ``bad`` that does not descend from ``good``.
    """
    good_sha, bad_sha = (git(root, "rev-parse", "--verify", "--end-of-options", f"{r}^{{commit}}").strip()
                         for r in (good, bad))
    if good_sha == bad_sha:
        raise InvalidInputError(f"--good {good} and --bad {bad} are the same commit {good_sha[:12]}")
    try:
        git(root, "merge-base", "--is-ancestor", good_sha, bad_sha)
    except InvalidInputError:
        raise InvalidInputError(f"--bad {bad} ({bad_sha[:12]}) does not descend from --good {good} "
                                f"({good_sha[:12]})") from None
    between = git(root, "rev-list", "--reverse", "--first-parent", f"{good_sha}..{bad_sha}").split()
    if git(root, "rev-parse", f"{between[0]}^1").strip() != good_sha:  # bisected in first-parent order only
        raise InvalidInputError(f"--good {good} ({good_sha[:12]}) is not on the first-parent history of --bad {bad}: "
                                "name a commit of that line (e.g. the merge that brought it in)")
    return good_sha, between


def runs_by_commit(store: Store) -> dict[str, list[RunHeader]]:
    """Every stored run's header, by the commit it built (clean trees only), newest run first."""
    found: dict[str, list[RunHeader]] = {}
    for key in store.list("runs/"):
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != "run.json":
            continue
        try:
            header = load_header(store, parts[1])
        except KilnError as exc:  # one unreadable run is skipped, never the end of the search
            log.warning("skipping stored run %s: %s", parts[1], exc)
            continue
        if header is not None and header.source.clean and header.source.commit:
            found.setdefault(header.source.commit, []).append(header)
    for headers in found.values():
        headers.sort(key=lambda h: h.created, reverse=True)
    return found


def stored_wheel(store: Store, headers: Sequence[RunHeader], variant: str, work: Path) -> tuple[Path, str] | None:
    """The newest run's wheel of ``variant`` among ``headers`` that the build ledger vouches for (fetched and
    hash-checked), and which run; a wheel the ledger contradicts is refused."""
    for header in headers:
        run = open_record(store, header.run_id, work / "runs")
        wheels = [a for a in run.artifacts() if a.kind == "wheel" and a.variant == variant and a.state == "ok"
                  and a.path.endswith(".whl")]
        for wheel in wheels[:1]:
            what = f"run {header.run_id}'s {variant} wheel {wheel.path}"
            if not vouched(store, header.source.commit, variant, wheel.path.rsplit("/", 1)[-1], wheel.sha256, what):
                log.warning("not using %s: the build ledger holds no hash for it", what)
                continue
            try:
                return run.fetch(wheel), f"run {header.run_id}"
            except IntegrityError as exc:  # missing or changed in the store: the next run, or a build
                log.warning("not using %s: %s", what, exc)
    return None


def cached_build(store: Store, commit: str, variant: str, work: Path) -> Path | None:
    """A wheel an earlier bisect built for ``commit`` and kept in the store, when the build ledger vouches for
    its bytes; one it does not vouch for was not kept by bisect and is refused."""
    prefix = f"{BISECT_WHEELS}/{commit}/{variant}/"
    for key in store.list(prefix):
        if not key.endswith(".whl"):
            continue
        data = store.get(key)
        if data is None:
            continue
        name = key.rsplit("/", 1)[-1]
        what = f"{store.url}/{key}"
        if not vouched(store, commit, variant, name, sha256_bytes(data), what):
            raise IntegrityError(f"refusing {what}: the build ledger holds no hash for it, so bisect did not keep it "
                                 f"(it keeps the hash first); delete it — nothing was installed")
        path = work / "cached" / commit[:12] / name
        atomic_write_bytes(path, data, durable=False)
        return path
    return None


def keep_build(store: Store, commit: str, variant: str, wheel: Path) -> None:
    """Keep a wheel bisect built, for the next bisect: its hash in the build ledger first, then the wheel (a
    half-kept one is a ledger entry without a wheel: built again). ``store`` holds the build step's
    credentials. Best effort: a wheel that cannot be kept is built again next time, and the log says why."""
    key = f"{BISECT_WHEELS}/{commit}/{variant}/{wheel.name}"
    data = wheel.read_bytes()
    digest = sha256_bytes(data)
    try:
        recorded = recorded_sha256(store, commit, variant, wheel.name)
        if recorded not in (None, digest):  # an earlier build of this commit did not reproduce: its bytes stand
            log.warning("not keeping the %s wheel built for %s: the build ledger holds another build's sha256 "
                        "%s for it", variant, commit[:12], recorded)
            return
        record_wheel(store, commit, variant, wheel.name, digest)
        store.put_immutable(key, data, "application/octet-stream", "no-cache")
    except KilnError as exc:
        log.warning("could not keep the %s wheel built for %s in %s: %s", variant, commit[:12], store.url, exc)


def checkout_tree(root: Path, commit: str, dest: Path) -> Path:
    """The files of ``commit`` (``git archive``) under ``dest``: the tests as that commit had them."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.parent / f"{dest.name}.tar"
    with archive.open("wb") as out:
        try:
            done = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", commit], stdout=out,
                                  stderr=subprocess.PIPE, timeout=GIT_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise PermanentError(f"git archive {commit[:12]} did not finish within {GIT_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise PermanentError(f"git archive {commit[:12]} failed: {done.stderr.decode(errors='replace').strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def first_bad(candidates: Sequence[str], is_bad: Callable[[str], bool]) -> str:
    """The first of ``candidates`` (oldest first; the last is known bad, the one before the first known good)
    for which ``is_bad`` holds, assuming once bad, bad after: ``log2(n)`` calls."""
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if is_bad(candidates[middle]):
            high = middle
        else:
            low = middle + 1
    return candidates[low]
