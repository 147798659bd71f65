"""Index generation and publish cost: Kiln vs dumb-pypi, incremental updates, S3 request count.

    python benchmarks/bench_index.py [--files 100000] [--projects 2000] [--repeats 5] [--s3-files 1000]

1. Full generation from a list (100,000 files across 2,000 projects): ``kiln
   index --from-list`` (through ``release.cli.index_command``) and ``dumb-pypi
   --package-list-json`` on the same entries, each a fresh process writing a
   fresh directory, alternated, median of ``--repeats`` runs. dumb-pypi is
   timed as configured by default and with ``--no-per-release-json`` (its own
   advice for large repositories); its default mode (per-release JSON, about
   100k more files) is timed once with ``--dumb-default``. The ratio uses the
   faster dumb-pypi mode.
2. Incremental: one wheel added to an existing project — pages rendered by
   ``release.index.regenerate`` and pages rewritten on disk by ``kiln index``.
3. S3 requests of a publish that adds one wheel to a channel already listing
   ``--s3-files`` files, against moto's S3 server on 127.0.0.1 (ephemeral port),
   counted per operation with a botocore event hook.

Prints a JSON document and a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from release.dists import from_record  # noqa: E402
from release.index import regenerate  # noqa: E402

TIMEOUT_S = 600
KILN_INDEX = "import sys; from release.cli import index_command; sys.exit(index_command(None, sys.argv[1], sys.argv[2]))"


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


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - start


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
    for repeat in range(repeats):
        for name, make in commands.items():  # alternated, so drift hits all tools alike
            if name == "dumb-pypi" and (repeat > 0 or not dumb_default):
                continue  # its default mode writes ~100k more files; optional, and timed once at most
            out = work / f"out-{repeat}-{name.replace(' ', '_')}"
            times[name].append(timed(make(out)))
            shutil.rmtree(out)
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    baseline = min(medians.get("dumb-pypi", float("inf")), medians["dumb-pypi --no-per-release-json"])
    return {"runs_s": times, "median_s": medians, "speedup_vs_fastest_dumb_pypi": baseline / medians["kiln"]}


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
    return {"regenerate_pages": sorted(pages), "regenerate_s": regen_s, "cli_summary": done.stdout.strip(), "cli_s": cli_s}


def bench_s3_requests(work: Path, existing: int) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    sys.path.insert(0, str(REPO / "tests" / "release"))
    from release.manifest import RunManifest
    from release.publish import publish
    from release.s3 import S3Store, make_client
    from wheelkit import make_wheel  # the tests' tiny-wheel builder

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    session = boto3.Session(aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1")
    client = make_client(session, "us-east-1", f"http://{host}:{port}")
    client.create_bucket(Bucket="bench")
    store = S3Store(client, "bench", "site")
    try:
        seed = RunManifest(root=work / "seed", run_id="seed")
        for n in range(existing):
            seed.add_artifact(make_wheel(work / "seed" / "wheels", "kiln-kernels", f"0.1.0.dev{n}+cu130"),
                              step="build", kind="wheel", variant="cu130")
        publish(seed, store, channel="nightly", channel_prefix="nightly", variants=["cu130"])
        run = RunManifest(root=work / "one", run_id="one")
        run.add_artifact(make_wheel(work / "one" / "wheels", "kiln-kernels", "0.2.0+cu130"), step="build",
                         kind="wheel", variant="cu130")
        counts: Counter[str] = Counter()
        client.meta.events.register("before-send.s3", lambda request, event_name, **_: counts.update(
            [event_name.rsplit(".", 1)[-1]]))
        start = time.perf_counter()
        plan = publish(run, store, channel="nightly", channel_prefix="nightly", variants=["cu130"])
        elapsed = time.perf_counter() - start
    finally:
        server.stop()
    return {"existing_files": existing, "requests": dict(counts), "total": sum(counts.values()),
            "pages_changed": plan.pages, "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--projects", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--s3-files", type=int, default=1_000)
    parser.add_argument("--work-dir", help="where outputs are written (default: the system temp dir)")
    parser.add_argument("--dumb-default", action="store_true",
                        help="also time dumb-pypi's default mode once (per-release JSON: ~100k more files)")
    args = parser.parse_args()
    rows = records(args.files, args.projects)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-index-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "files": len(rows), "projects": args.projects, "repeats": args.repeats,
            "full": bench_full(work, rows, args.repeats, args.dumb_default),
            "incremental": bench_incremental(work, rows),
            "s3": bench_s3_requests(work, args.s3_files) if args.s3_files else None,
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
