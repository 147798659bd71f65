"""The compile cache's shared tier: a second worker's nvcc library build against its own cold build.

The library is tests/fixtures/projects/multicu's (three ``.cu`` and one ``.cpp``, nvcc for sm_90), built by
Kiln's nvcc unit function (``build_library_counted``: one sandboxed ccache'd nvcc call per translation unit and
arch, then the link). Each repeat, in fresh directories and one fresh store:

- ``cold``: worker A, an empty local compile cache and an empty shared tier: every translation unit compiles
  (and is written to the shared tier);
- ``second_worker``: worker B, another clone and an empty local compile cache, with A's shared tier: it
  compiles nothing;
- ``second_worker_one_file``: worker C, empty local cache, the shared tier, one ``.cu`` changed by a line:
  that translation unit alone compiles.

``--store file`` uses a ``file://`` folder (ccache's ``file:`` backend); ``--store s3`` a moto S3 server on
loopback through Kiln's storage helper bridge (needs moto). Ratios are each median over ``cold``'s median of
the same run; translation units compiled and the shared tier's size are reported beside them.

Usage::

    python benchmarks/bench_compile_cache_shared.py [--repeats 3] [--store file|s3]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "projects" / "multicu" / "multicu" / "csrc"
SOURCES = ("scale.cu", "shift.cu", "square.cu", "api.cpp")
ARCHS = ("9.0",)


@contextmanager
def open_shared(kind: str, root: Path) -> Iterator[object]:
    """A fresh store of ``kind``: a file:// folder, or a bucket on a loopback moto server."""
    from kiln.core.store import LocalStore

    if kind == "file":
        yield LocalStore(root / "store")
        return
    import boto3

    from kiln.core.s3 import S3Store, make_client
    from tests.helpers.s3 import S3_ENV, moto_s3_server

    with moto_s3_server() as url:
        session = boto3.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                                aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        client = make_client(session, "us-east-1", url)
        bucket = f"bench-{root.name.lower().replace('_', '-')}"  # moto's buckets outlive its server in this process
        client.create_bucket(Bucket=bucket)
        yield S3Store(client, bucket, "artifacts")


def build(store: object, worker: Path, change: bool = False) -> tuple[float, int, int, bytes]:
    """One worker's library build: seconds, translation units compiled, served by the shared tier, the bytes."""
    from kiln.tasks.build.compile_cache import open_compile_cache
    from kiln.tasks.build.compile_tier import shared_tier
    from kiln.tasks.build.nvcc import build_library_counted, find_nvcc
    from kiln.tasks.project.config_build import BuildCacheSettings

    shutil.copytree(FIXTURE, worker / "csrc")
    if change:
        shift = worker / "csrc" / "shift.cu"
        shift.write_text(shift.read_text().replace("x[i] += b", "x[i] += 2.0f * b"))
    start = time.perf_counter()
    cache = open_compile_cache(worker / "cache", shared_tier(BuildCacheSettings(remote="artifacts"), store))  # type: ignore[arg-type]
    data, stats = build_library_counted(find_nvcc(), [worker / "csrc" / n for n in SOURCES], "libmulticu.so",
                                        ARCHS, timeout=900, cache=cache)
    seconds = time.perf_counter() - start
    del cache  # the build ends: an s3 tier's bridge stops
    return seconds, len(stats.compiled), len(stats.shared), data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", choices=("file", "s3"), default="file")
    args = parser.parse_args()
    names = ("cold", "second_worker", "second_worker_one_file")
    times: dict[str, list[float]] = {n: [] for n in names}
    counts: dict[str, tuple[int, int]] = {}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="kiln-bench-ccs-") as tmp, open_shared(args.store, Path(tmp)) as store:
            results = {}
            for name, change in zip(names, (False, False, True), strict=True):
                results[name] = build(store, Path(tmp) / name, change)
                times[name].append(results[name][0])
                counts[name] = results[name][1:3]
            assert results["second_worker"][3] == results["cold"][3], "a shared hit must be the compile's bytes"
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {results[n][0]:.2f} s" for n in names), flush=True)
    cold = statistics.median(times["cold"])
    print(f"\n{platform.node()} ({platform.machine()}), store {args.store}, {args.repeats} repeats")
    print("| build | median s | ratio to cold | compiled / from the shared tier |")
    print("|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.2f} | {median / cold:.3f} | {counts[name][0]} / {counts[name][1]} |")
    print("all runs (s): " + "; ".join(f"{n} " + " / ".join(f"{t:.2f}" for t in times[n]) for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
