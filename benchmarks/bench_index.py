"""Index generation and publish cost: Kiln vs dumb-pypi, incremental updates, S3 request count.

    python benchmarks/bench_index.py [--files 100000] [--projects 2000] [--repeats 5] [--s3-files 1000]

1. Full generation from a list (100,000 files across 2,000 projects): ``kiln
   index --from-list`` (through ``kiln.release.cli.index_command``) and ``dumb-pypi
   --package-list-json`` on the same entries, each a fresh process writing a
   fresh directory, alternated, median of ``--repeats`` runs. dumb-pypi is
   timed as configured by default and with ``--no-per-release-json`` (its own
   advice for large repositories); its default mode (per-release JSON, about
   100k more files) is timed once with ``--dumb-default``. The ratio uses the
   faster dumb-pypi mode.
2. Incremental: one wheel added to an existing project — pages rendered by
   ``kiln.release.index.render.regenerate`` and pages rewritten on disk by ``kiln index``.
3. S3 requests of a publish that adds one wheel to a channel already listing
   ``--s3-files`` files, and of re-running that publish, against moto's S3
   server on 127.0.0.1 (ephemeral port), counted per operation with a botocore
   event hook — for a store that reads writes back (moto, any custom endpoint)
   and for one that verifies checksums (AWS semantics, see
   :func:`bench_s3_requests`).

Prints a JSON document and a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln.core.dists import from_record  # noqa: E402
from kiln.release.index.render import regenerate  # noqa: E402

TIMEOUT_S = 600
KILN_INDEX = ("import sys; from kiln.release.cli import index_command;"
              " sys.exit(index_command(None, sys.argv[1], sys.argv[2]))")
# bench_s3_requests on another tree's release/ (argv: RELEASE_DIR WORK_DIR FILES), for before/after counts.
S3_BASELINE = """
import inspect, json, sys, types
from pathlib import Path
release = types.ModuleType("kiln.release")
release.__path__ = [sys.argv[1]]
sys.modules["kiln.release"] = release  # the baseline's modules instead of the installed ones
import kiln.core.s3 as s3
if "verifies_checksums" not in inspect.signature(s3.S3Store).parameters:
    class S3Store(s3.S3Store):  # a baseline from before the switch: it had one behaviour for both
        def __init__(self, *args, verifies_checksums=False, **kwargs):
            super().__init__(*args, **kwargs)
    s3.S3Store = S3Store
sys.path.insert(0, sys.argv[4])
import bench_index
print(json.dumps(bench_index.bench_s3_requests(Path(sys.argv[2]), int(sys.argv[3]))))
"""


def records(files: int, projects: int) -> list[dict]:
    per_project = files // projects
    out = []
    for p in range(projects):
        for v in range(per_project):
            n = p * per_project + v
            record = {
                "filename": f"proj_{p:04d}-1.{v}.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl",
                "sha256": f"{n:064x}", "size": 1000 + n, "upload_time": 1_700_000_000 + n,
                "requires_python": ">=3.10",
            }
            if v % 2 == 0:
                record["metadata_sha256"] = f"{n + 1:064x}"
            out.append(record)
    return out


def dumb_pypi_record(record: dict) -> dict:
    converted = {"filename": record["filename"], "hash": f"sha256={record['sha256']}",
                 "requires_python": record["requires_python"], "upload_timestamp": record["upload_time"]}
    if "metadata_sha256" in record:
        converted["core_metadata"] = f"sha256={record['metadata_sha256']}"
    return converted


def write_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run; CPU time says what load on a shared machine hides."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def bench_full(work: Path, rows: list[dict], repeats: int, dumb_default: bool) -> dict:
    kiln_list, dumb_list = work / "kiln.jsonl", work / "dumb.jsonl"
    write_lines(kiln_list, rows)
    write_lines(dumb_list, [dumb_pypi_record(r) for r in rows])
    dumb = shutil.which("dumb-pypi") or str(Path(sys.executable).parent / "dumb-pypi")
    commands = {
        "kiln": lambda out: [sys.executable, "-c", KILN_INDEX, str(kiln_list), str(out)],
        "dumb-pypi": lambda out: [dumb, "--package-list-json", str(dumb_list), "--output-dir", str(out),
                                  "--packages-url", "../../packages/", "--no-generate-timestamp"],
        "dumb-pypi --no-per-release-json": lambda out: [
            dumb, "--package-list-json", str(dumb_list), "--output-dir", str(out), "--packages-url",
            "../../packages/", "--no-generate-timestamp", "--no-per-release-json"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for repeat in range(repeats):
        for name, make in commands.items():  # alternated, so drift hits all tools alike
            if name == "dumb-pypi" and (repeat > 0 or not dumb_default):
                continue  # its default mode writes ~100k more files; optional, and timed once at most
            out = work / f"out-{repeat}-{name.replace(' ', '_')}"
            wall, cpu_s = timed(make(out))
            times[name].append(wall)
            cpu[name].append(cpu_s)
            shutil.rmtree(out)  # the next tool writes right after this delete, as `rm -rf out && tool` would
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    baseline = min(medians.get("dumb-pypi", float("inf")), medians["dumb-pypi --no-per-release-json"])
    return {"runs_s": times, "median_s": medians, "speedup_vs_fastest_dumb_pypi": baseline / medians["kiln"],
            "cpu_s": cpu, "median_cpu_s": {name: statistics.median(t) for name, t in cpu.items() if t}}


def bench_incremental(work: Path, rows: list[dict]) -> dict:
    listing = work / "incr.jsonl"
    write_lines(listing, rows)
    out = work / "incr-out"
    subprocess.run([sys.executable, "-c", KILN_INDEX, str(listing), str(out)], check=True, timeout=TIMEOUT_S,
                   cwd=REPO, capture_output=True)
    added = dict(rows[0], filename="proj_0000-9.9.9+cu130-cp311-cp311-manylinux_2_28_x86_64.whl", sha256="f" * 64)
    write_lines(listing, [*rows, added])
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", KILN_INDEX, str(listing), str(out)], check=True, timeout=TIMEOUT_S,
                          cwd=REPO, capture_output=True, text=True)
    cli_s = time.perf_counter() - start
    before = [from_record(r) for r in rows]
    start = time.perf_counter()
    pages = regenerate(before, [*before, from_record(added)])
    regen_s = time.perf_counter() - start
    return {"regenerate_pages": sorted(pages), "regenerate_s": regen_s, "cli_summary": done.stdout.strip(),
            "cli_s": cli_s}


def bench_s3_requests(work: Path, existing: int) -> dict:
    """Requests by operation of adding one wheel to a channel of ``existing`` files, then of re-running it.

    Two store semantics on the same moto server: ``moto`` (``verifies_checksums``
    false, as for any custom endpoint: every write is read back) and ``aws``
    (``verifies_checksums`` true, with the checksum echo AWS sends after
    verifying simulated by a botocore hook; moto itself still checks nothing,
    so this counts requests, it does not test verification).
    """
    import boto3
    from moto.server import ThreadedMotoServer

    sys.path.insert(0, str(REPO / "tests" / "release"))
    from faults import echo_checksums  # the tests' simulation of AWS's checksum echo
    from wheelkit import make_wheel  # the tests' tiny-wheel builder

    from kiln.core.dists import make_distribution
    from kiln.core.manifest import RunManifest
    from kiln.core.s3 import S3Store, make_client
    from kiln.release.index.render import HTML_TYPE, JSON_TYPE, generate
    from kiln.release.publish.pages import PAGE_CACHE
    from kiln.release.publish.protocol import PublishRequest, publish

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    session = boto3.Session(aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1")
    # The channel's pages as ``existing`` earlier publishes left them. Only the pages are
    # written: adding a wheel never reads the other files, and uploading them all through
    # moto takes minutes on a loaded machine.
    listed = generate(make_distribution(f"kiln_kernels-0.1.0.dev{n}+cu130-py3-none-any.whl", f"{n:064x}", 1000,
                                        1_700_000_000 + n, metadata_sha256=f"{n + 1:064x}") for n in range(existing))
    run = RunManifest(root=work / "one", run_id="one")
    run.add_artifact(make_wheel(work / "one" / "wheels", "kiln-kernels", "0.2.0+cu130"), step="build",
                     kind="wheel", variant="cu130")
    result: dict = {"existing_files": existing}
    try:
        for semantics in ("moto", "aws"):
            client = make_client(session, "us-east-1", f"http://{host}:{port}")
            client.create_bucket(Bucket=f"bench-{semantics}")
            if semantics == "aws":
                echo_checksums(client)
            store = S3Store(client, f"bench-{semantics}", "site", verifies_checksums=semantics == "aws")
            for key, data in listed.items():
                store.put_page(f"nightly/cu130/simple/{key}", data, HTML_TYPE if key.endswith(".html") else JSON_TYPE,
                               PAGE_CACHE, None)
            counts: Counter[str] = Counter()
            client.meta.events.register("before-send.s3", lambda event_name, counts=counts, **_: counts.update(
                [event_name.rsplit(".", 1)[-1]]))
            for step in ("add", "rerun"):
                counts.clear()
                start = time.perf_counter()
                plan = publish(run, store,
                               PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]))
                result[f"{semantics}_{step}"] = {
                    "requests": dict(sorted(counts.items())), "total": sum(counts.values()),
                    "added": len(plan.keys("added")), "pages_changed": plan.pages,
                    "seconds": time.perf_counter() - start}
    finally:
        server.stop()
    return result


def bench_s3_baseline(work: Path, release_dir: Path, existing: int) -> dict:
    """:func:`bench_s3_requests` run on the code of ``release_dir`` (another commit's ``release/``)."""
    (work / "baseline").mkdir()
    done = subprocess.run([sys.executable, "-c", S3_BASELINE, str(release_dir.resolve()), str(work / "baseline"),
                           str(existing), str(Path(__file__).resolve().parent)], check=True, timeout=TIMEOUT_S,
                          cwd=REPO, capture_output=True, text=True)
    return {"release_dir": str(release_dir), **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--projects", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--s3-files", type=int, default=1_000)
    parser.add_argument("--s3-baseline", type=Path, metavar="RELEASE_DIR",
                        help="also count the S3 requests of another tree's release/ (e.g. a `git archive` of the"
                             " previous commit), in the same run")
    parser.add_argument("--only", choices=("full", "incremental", "s3"), action="append",
                        help="run only these parts (repeatable; default: all)")
    parser.add_argument("--work-dir", help="where outputs are written (default: the system temp dir)")
    parser.add_argument("--dumb-default", action="store_true",
                        help="also time dumb-pypi's default mode once (per-release JSON: ~100k more files)")
    args = parser.parse_args()
    rows = records(args.files, args.projects)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-index-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        parts = set(args.only or ("full", "incremental", "s3"))
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "load_average_at_start": os.getloadavg(),
            "files": len(rows), "projects": args.projects, "repeats": args.repeats,
            "full": bench_full(work, rows, args.repeats, args.dumb_default) if "full" in parts else None,
            "incremental": bench_incremental(work, rows) if "incremental" in parts else None,
            "s3": bench_s3_requests(work, args.s3_files) if args.s3_files and "s3" in parts else None,
            "s3_baseline": (bench_s3_baseline(work, args.s3_baseline, args.s3_files)
                            if args.s3_baseline and args.s3_files and "s3" in parts else None),
        }
        result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
