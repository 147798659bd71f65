"""Compile every registry specialization ahead of time, no GPU needed.

    python -m kiln_kernels.compile_all --target cuda:9.0 --target hip:gfx942 [--out DIR]

A smoke check for the build stage and for kernel authors: a specialization
that does not compile for a target fails here, not on a user's machine. Must
run without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from kiln_kernels import aot
from kiln_kernels.registry import registry, targets_for

_log = logging.getLogger(__name__)


def compile_all(targets: list[tuple[str, str]], out: Path | None = None) -> list[tuple[str, str, float]]:
    """Compile all specializations for each ``(backend, arch)``; returns
    ``(unit, target, seconds)`` rows. Raises on the first compile failure."""
    rows = []
    for spec in registry():
        for entry in spec.triton:
            for s in entry.specializations:
                for backend, arch in targets:
                    if not targets_for(s, backend, arch) or arch not in spec.supported.get(backend, ()):
                        continue
                    start = time.perf_counter()
                    compiled = aot.compile_specialization(entry.fn, s, aot.target_for(backend, arch))
                    if out is not None:
                        stem = f"{spec.name}.{entry.name}.{s.name}"
                        aot.write_artifact(compiled, out / f"{backend}-{arch}", stem)
                    rows.append((f"{spec.name}/{entry.name}/{s.name}", f"{backend}:{arch}",
                                 time.perf_counter() - start))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="backend:arch, e.g. cuda:9.0")
    parser.add_argument("--out", type=Path, help="write artifacts here")
    args = parser.parse_args(argv)
    targets = [tuple(t.split(":", 1)) for t in args.target]
    rows = compile_all(targets, args.out)  # type: ignore[arg-type]
    for unit, target, seconds in rows:
        print(f"{unit:60s} {target:12s} {seconds:6.2f}s")
    print(f"{len(rows)} compiles, {sum(r[2] for r in rows):.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
