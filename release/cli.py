"""Plain functions behind ``kiln index``, ``kiln verify`` and ``kiln which`` (no Prefect needed).

They return an exit status and print a short summary; ``flows/cli/`` wires
them to the command line.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core import nofollow
from kiln.core.dists import Distribution, from_records
from kiln.core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, IntegrityError, InvalidInputError, KilnError
from kiln.core.fsutil import write_new_tree
from kiln.core.owneronly import owner_only_dir
from kiln.release.index.render import generate

if TYPE_CHECKING:  # urllib.request and http.client cost ~25 ms of every `kiln index` start
    from kiln.release.read.fetch import StoreSettings
    from kiln.release.which.environment import Asked

log = logging.getLogger(__name__)

WRITE_THREADS = 32
INDEX_PUBLIC_REMEDY = "pass --public if another user's web server serves it on purpose"


def read_list(path: Path) -> list[Distribution]:
    """Distributions from a JSON-lines file; a bad line is an error naming its number."""
    # The records hold no reference cycles, yet each of their many allocations counts towards
    # a collection that walks them all: measured ~14% of reading a 100k list. Paused, not off.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _read_list(path)
    finally:
        if paused:
            gc.enable()


def _read_list(path: Path) -> list[Distribution]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"list file {path}: {exc}") from exc
    body = text.rstrip("\n")
    records = _parse_joined(body.replace("\n", ","), body.count("\n") + 1 if body else 0)
    if records is not None:  # one value on every line: record i is on line i + 1
        return from_records(records, lambda i: f"{path}:{i + 1}")
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = _parse_joined(",".join(line for _, line in numbered), len(numbered))  # blank lines skipped
    if records is None:  # find the bad line, to name it
        records = []
        for number, line in numbered:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{path}:{number}: not valid JSON: {exc}") from exc
    return from_records(records, lambda i: f"{path}:{numbered[i][0]}")


def _parse_joined(joined: str, count: int) -> list[object] | None:
    """JSON values joined by ',' parsed at once (several times faster than one parse per line);
    None unless that gives exactly ``count`` values (a blank line gives ',,', not JSON)."""
    try:
        records = json.loads(f"[{joined}]")
    except json.JSONDecodeError:
        return None
    return records if len(records) == count else None


def read_wheel_dir(directory: Path) -> tuple[list[Distribution], dict[str, tuple[Path, bytes]]]:
    """Every ``*.whl`` in ``directory``: records, and (source, METADATA bytes) by filename."""
    from kiln.core.wheels import check_record, read_wheel  # zip and email parsing only for a wheel directory

    if not directory.is_dir():
        raise InvalidInputError(f"wheel directory {directory} does not exist")
    dists, files = [], {}
    for path in sorted(directory.glob("*.whl")):
        dist, metadata = read_wheel(path)
        check_record(path.name, path)  # a wheel whose RECORD lies is refused, not indexed
        dists.append(dist)
        files[dist.filename] = (path, metadata)
    if not dists:
        raise InvalidInputError(f"{directory} holds no *.whl files")
    return dists, files


def write_index(out: Path, pages: dict[str, bytes], *, private: bool = False) -> tuple[int, int]:
    """Write the pages whose bytes differ from what ``out`` holds; (written, unchanged).

    A new (absent or empty) ``out`` is written as one tree renamed into place,
    so readers see no index or all of it. Otherwise each changed page is
    written atomically (fsync, then rename); a thread pool overlaps the fsyncs.
    Below ``out`` no symbolic link is followed, for reading or writing: every
    page is read (compared) before any is written, so a link anywhere is
    refused (UnsafePathError naming it) before anything changes. ``private``: a new ``out`` is ``0700``.
    """
    if write_new_tree(out, pages, private=private):
        return len(pages), 0
    from concurrent.futures import ThreadPoolExecutor  # threads only for an update in place

    current = nofollow.read_files(out, list(pages))
    changed = [rel for rel, data in pages.items() if current[rel] != data]
    with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
        list(pool.map(lambda rel: nofollow.write_file(out, out / rel, pages[rel]), changed))
    return len(changed), len(pages) - len(changed)


def _copy_files(out: Path, dists: list[Distribution], files: dict[str, tuple[Path, bytes]]) -> None:
    """Put each wheel and its sidecar beside its project page; never replace other bytes under a name.

    Nothing is written until every path is checked: no link below ``out``, no
    other bytes under a wheel's name. Wheels are copied streaming.
    """
    present = set()
    for dist in dists:
        target = out / dist.project / dist.filename
        existing = nofollow.file_sha256(out, target)
        if existing is not None and existing != dist.sha256:
            raise IntegrityError(f"{target} already holds other bytes than {files[dist.filename][0]};"
                                 " refusing to replace it")
        if existing is not None:
            present.add(dist.filename)
    for dist in dists:
        source, metadata = files[dist.filename]
        if dist.filename not in present:
            nofollow.copy_file(out, source, out / dist.project / dist.filename)
        sidecar = out / dist.project / f"{dist.filename}.metadata"
        if nofollow.read_file(out, sidecar) != metadata:
            nofollow.write_file(out, sidecar, metadata)


def index_command(wheel_dir: str | None, from_list: str | None, out: str, public: bool = False) -> int:
    """``kiln index WHEEL_DIR --out DIR`` or ``kiln index --from-list F.jsonl --out DIR``.

    ``DIR`` is this user's alone (``0700``) unless ``public`` (``--public``: ``0755``, for a web server of
    another user's); an existing one another user owns or may write into is refused unless ``public``
    (:mod:`kiln.core.owneronly`)."""
    if (wheel_dir is None) == (from_list is None):
        print("kiln index: give exactly one of WHEEL_DIR or --from-list FILE", file=sys.stderr)
        return EXIT_USAGE
    try:
        if from_list is not None:
            dists, files = read_list(Path(from_list)), dict[str, tuple[Path, bytes]]()
        else:
            dists, files = read_wheel_dir(Path(wheel_dir))  # type: ignore[arg-type]
        pages = generate(dists)  # validates everything before anything is written
        out_dir = Path(out)
        owner_only_dir(out_dir, "kiln index --out", public=public, remedy=INDEX_PUBLIC_REMEDY)
        if files:
            wheels = [f"{d.project}/{d.filename}{suffix}" for d in dists for suffix in ("", ".metadata")]
            nofollow.check_tree(out_dir, [*pages, *wheels])  # a link anywhere: refused before any write
            _copy_files(out_dir, dists, files)
        written, unchanged = write_index(out_dir, pages, private=not public)
    except KilnError as exc:
        print(f"kiln index: {exc}", file=sys.stderr)
        return exc.exit_status
    except OSError as exc:
        print(f"kiln index: {exc}", file=sys.stderr)
        return EXIT_FAILED
    projects = len({d.project for d in dists})
    print(f"kiln index: {len(dists)} files, {projects} projects -> {out}"
          f" ({written} pages written, {unchanged} unchanged)")
    return EXIT_OK


def verify_command(url: str, install: bool = True, extra_index_urls: Sequence[str] = (),
                   settings: StoreSettings | None = None, hints: Sequence[str] = (),
                   public_url: str | None = None) -> int:
    """``kiln verify URL``: check every page, link, hash and sidecar, then install with pip and uv.

    ``extra_index_urls`` are where the dependencies resolve from; ``settings``
    opens an ``s3://`` URL (the publish target's region, endpoint and owner); ``hints`` are printed install
    commands to run, each of which must install the published version. ``public_url``: the CDN in front of
    ``url``, through which every page and file must be served with the index's bytes (:mod:`kiln.release.read.public`).
    """
    from kiln.release.read.public import public_root, verify_public
    from kiln.release.read.verify import verify_index  # http and subprocess machinery only when verifying

    try:
        if public_url is not None:
            public_root(public_url)  # a bad public URL is refused before anything is fetched
        report = verify_index(url, install=install, extra_index_urls=extra_index_urls, settings=settings,
                              hints=hints)
        public = None if public_url is None else verify_public(url, public_url, settings=settings)
    except KilnError as exc:
        print(f"kiln verify: {exc}", file=sys.stderr)
        return exc.exit_status
    print(report.summary())
    if public is not None:
        print(public.summary())
    return EXIT_OK if report.ok and (public is None or public.ok) else EXIT_FAILED


def which_command(url: str, project: str | None, version: str | None, asked: Asked,
                  extra_index_urls: Sequence[str] = (), timeout: float = 60.0) -> int:
    """``kiln which URL``: print the install command of the wheel that fits the environment, or why none does."""
    from kiln.release.which.environment import environment
    from kiln.release.which.pick import Choice, select
    from kiln.release.which.reading import install_command, read_listing

    try:
        env = environment(asked)
        listing = read_listing(url, project, version, timeout)
    except KilnError as exc:
        print(f"kiln which: {exc}", file=sys.stderr)
        return exc.exit_status
    answer = select(env, listing.candidates)
    if not isinstance(answer, Choice):
        print(f"kiln which: no wheel of {listing.project} {listing.version} on {url} fits {env.describe()}:")
        print("\n".join(f"  - {reason}" for reason in answer.reasons))
        return EXIT_FAILED
    print(f"kiln which: {answer.candidate.filename} fits {env.describe()}")
    for note in answer.unchecked:
        print(f"  ({note})")
    print(install_command(url, listing, answer.candidate, extra_index_urls))
    return EXIT_OK
