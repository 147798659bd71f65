"""Plain functions behind ``kiln index`` and ``kiln verify`` (no Prefect needed).

They return an exit status and print a short summary; ``flows/cli.py`` wires
them to the command line.
"""

from __future__ import annotations

import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from release.dists import Distribution, from_record
from release.errors import IntegrityError, InvalidInputError, KilnError
from release.fsutil import atomic_write_bytes, sha256_file
from release.index import generate
from release.wheels import read_wheel

log = logging.getLogger("kiln.cli")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
WRITE_THREADS = 32


def read_list(path: Path) -> list[Distribution]:
    """Distributions from a JSON-lines file; a bad line is an error naming its number."""
    try:
        numbered = [(n, line) for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
                    if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"list file {path}: {exc}") from exc
    try:  # one parse of the whole file is ~2x faster than one per line
        records = json.loads("[" + ",".join(line for _, line in numbered) + "]")
    except json.JSONDecodeError:
        records = None
    if records is None or len(records) != len(numbered):  # find the bad line, to name it
        records = []
        for number, line in numbered:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{path}:{number}: not valid JSON: {exc}") from exc
    return [from_record(record, f"{path}:{number}") for (number, _), record in zip(numbered, records)]


def read_wheel_dir(directory: Path) -> tuple[list[Distribution], dict[str, tuple[Path, bytes]]]:
    """Every ``*.whl`` in ``directory``: records, and (source, METADATA bytes) by filename."""
    if not directory.is_dir():
        raise InvalidInputError(f"wheel directory {directory} does not exist")
    dists, files = [], {}
    for path in sorted(directory.glob("*.whl")):
        dist, metadata = read_wheel(path)
        dists.append(dist)
        files[dist.filename] = (path, metadata)
    if not dists:
        raise InvalidInputError(f"{directory} holds no *.whl files")
    return dists, files


def write_index(out: Path, pages: dict[str, bytes]) -> tuple[int, int]:
    """Write the pages whose bytes differ from what ``out`` holds; (written, unchanged).

    Each page is written atomically (fsync, then rename); a thread pool
    overlaps the fsyncs, which otherwise dominate the time of a large index.
    """
    changed = []
    for rel, data in pages.items():
        try:
            if (out / rel).read_bytes() == data:
                continue
        except FileNotFoundError:
            pass
        changed.append(rel)
    with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
        list(pool.map(lambda rel: atomic_write_bytes(out / rel, pages[rel]), changed))
    return len(changed), len(pages) - len(changed)


def _copy_files(out: Path, dists: list[Distribution], files: dict[str, tuple[Path, bytes]]) -> None:
    """Put each wheel and its sidecar beside its project page; never replace other bytes under a name."""
    for dist in dists:  # check everything before writing anything
        target = out / dist.project / dist.filename
        if target.exists() and sha256_file(target) != dist.sha256:
            raise IntegrityError(f"{target} already holds other bytes than {files[dist.filename][0]}; refusing to replace it")
    for dist in dists:
        source, metadata = files[dist.filename]
        target = out / dist.project / dist.filename
        if not target.exists():
            atomic_write_bytes(target, source.read_bytes())
        sidecar = out / dist.project / f"{dist.filename}.metadata"
        if not sidecar.exists() or sidecar.read_bytes() != metadata:
            atomic_write_bytes(sidecar, metadata)


def index_command(wheel_dir: str | None, from_list: str | None, out: str) -> int:
    """``kiln index WHEEL_DIR --out DIR`` or ``kiln index --from-list F.jsonl --out DIR``."""
    if (wheel_dir is None) == (from_list is None):
        print("kiln index: give exactly one of WHEEL_DIR or --from-list FILE", file=sys.stderr)
        return EXIT_USAGE
    try:
        if from_list is not None:
            dists, files = read_list(Path(from_list)), {}
        else:
            dists, files = read_wheel_dir(Path(wheel_dir))  # type: ignore[arg-type]
        pages = generate(dists)  # validates everything before anything is written
        out_dir = Path(out)
        if files:
            _copy_files(out_dir, dists, files)
        written, unchanged = write_index(out_dir, pages)
    except KilnError as exc:
        print(f"kiln index: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidInputError) else EXIT_FAILED
    except OSError as exc:
        print(f"kiln index: {exc}", file=sys.stderr)
        return EXIT_FAILED
    projects = len({d.project for d in dists})
    print(f"kiln index: {len(dists)} files, {projects} projects -> {out} ({written} pages written, {unchanged} unchanged)")
    return EXIT_OK


def verify_command(url: str, install: bool = True) -> int:
    """``kiln verify URL``: check every page, link, hash and sidecar, then install with pip and uv."""
    from release.verify import verify_index  # http and subprocess machinery only when verifying

    try:
        report = verify_index(url, install=install)
    except KilnError as exc:
        print(f"kiln verify: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_FAILED
