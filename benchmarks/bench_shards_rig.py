"""Sharding on the scale-out rig: a dispatched suite's wall with 1 shard and with 2 (or the counts ``--shards``
names), on two GPU nodes.

The rig is the docs' "Scaling out" recipe on loopback (PostgreSQL, a Prefect server on it, moto's S3 server;
tests/helpers/cluster.py) with the ``acme`` project, two build workers and two simulated GPU nodes, each made
the recipe's way (its ``gpu-<node>`` limit of 1 GPU and one ``--limit 1`` worker on the GPU pool). On one
node of one GPU the shards would take its GPU in turn (the limit says so), and two shards could only add
their environments' set-up. The project's GPU suite is replaced by ``tests/fixtures/suites/sharded`` (40 tests
that sleep 0.1 to 0.8 s each at ``--scale`` 10, 18 s in all) on that pool. A first nightly (``shards = 2``,
not measured) records the tests' durations; then each repeat runs one nightly with ``shards = 1`` and one
with ``shards = 2`` (a commit each, order alternating, every test run: ``full=true``).

Per nightly: **suite wall**, from the first of the suite's dispatched flow runs being created to the last one
ending (Prefect's own timestamps: the dispatch, a worker picking it up, the flow run's start, its environment,
its tests), each run's start and end, and each shard's tests' own seconds from its report. The ratio is 2
shards' median suite wall over 1 shard's, both measured in this run. Every process of the rig shares this
machine's two cores.

Usage::

    python benchmarks/bench_shards_rig.py [--repeats 3] [--scale 10] [--shards 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXTURE = REPO / "tests" / "fixtures" / "suites" / "sharded" / "test_sleeps.py"
NIGHTLY_DEADLINE_S = 1800


def _with_suite(project: Path, scale: float) -> None:
    """The sharded fixture suite in ``project`` (its sleep scale fixed in the copy), the GPU suite removed."""
    from tests.helpers.cluster import with_sharded_suite

    (project / "sharded").mkdir()
    text = FIXTURE.read_text()
    default = 'os.environ.get("KILN_SHARD_SLEEP_SCALE", "1")'
    assert default in text, "the sharded fixture's scale changed: update this benchmark"
    (project / "sharded" / "test_sleeps.py").write_text(
        text.replace(default, f'os.environ.get("KILN_SHARD_SLEEP_SCALE", "{scale:g}")'))
    with_sharded_suite(project, 2)


def _set_shards(project: Path, shards: int, when: str) -> None:
    from tests.helpers.gitrepo import commit_all

    config = project / "kiln.toml"
    text = config.read_text()
    start = text.index('name = "sharded"')
    at = text.index("shards = ", start)
    end = text.index("\n", at)
    config.write_text(text[:at] + f"shards = {shards}" + text[end:])
    commit_all(project, f"the sharded suite in {shards} shard(s)", when=when)


def _suite_runs(made, run_id: str) -> list:
    with made.client() as client:
        return [r for r in client.read_flow_runs(limit=200) if r.parameters.get("run_id") == run_id
                and r.deployment_id is not None and r.parameters.get("suites") == ["sharded"]]


def _test_seconds(endpoint: str, run_id: str, out: Path) -> list[float]:
    from kiln.core.record import open_record
    from kiln.core.store import open_store
    from tests.helpers.cluster import ARTIFACTS

    store = open_store(f"s3://{ARTIFACTS}/store", root=out, region="us-east-1", endpoint=endpoint)
    record = open_record(store, run_id, out)
    reports = sorted((a for a in record.artifacts() if a.kind == "report" and "sharded.cu130" in a.path
                      and a.path.endswith(".json")), key=lambda a: a.path)
    return [sum(t.get("duration_s", 0.0) for t in json.loads(record.fetch(a).read_text())["tests"]) for a in reports]


def _timeline(runs: list) -> str:
    """Each suite run's start and end, seconds after the first was created (Prefect's timestamps)."""
    t0 = min(r.created for r in runs)
    return ", ".join(f"[{(r.start_time - t0).total_seconds():.1f} → {(r.end_time - t0).total_seconds():.1f}]"
                     for r in sorted(runs, key=lambda r: r.start_time))


def _nightly(made, endpoint: str, tmp: Path, full: bool = True) -> tuple[float, list[float], str]:
    """One nightly: its suite wall (first shard created → last ended), each shard's tests' summed durations, and
    its suite runs' timeline."""
    from tests.helpers.cluster import recipe, trigger

    line = recipe()[-1] + (" --param full=true" if full else "")
    run_id = trigger(made, line)
    final = made.wait_final(run_id, NIGHTLY_DEADLINE_S)
    runs = _suite_runs(made, run_id)
    if not runs or any(r.end_time is None or r.start_time is None for r in runs):
        raise SystemExit(f"nightly {run_id} ({final.state.name}: {final.state.message}): suite runs {runs}")
    wall = (max(r.end_time for r in runs) - min(r.created for r in runs)).total_seconds()
    return wall, _test_seconds(endpoint, run_id, tmp / run_id), _timeline(runs)


def _second_gpu_node(made) -> None:
    """A second simulated GPU node, made the recipe's way: its ``gpu-<node>`` limit and its worker."""
    from tests.helpers.cluster import recipe

    limit = next(line for line in recipe() if line.startswith("prefect gcl create"))
    worker = next(line for line in recipe() if "--pool kiln-gpu" in line)
    assert '"gpu-$GPU_NODE"' in limit, f"the recipe's limit line changed: update this benchmark ({limit})"
    made.run(limit.replace('"gpu-$GPU_NODE"', "gpu-node2"))
    made.workers["kiln-gpu"].append(made.start(worker, "worker-kiln-gpu-node2", {
        "GPU_NODE": "node2", "KILN_GPU_COUNT": "1", "TRITON_INTERPRET": "1"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--shards", default="1,2", help="shard counts to measure, comma-separated (1 is the baseline)")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.shards.split(",")} | {1})
    import boto3

    from tests.helpers.cluster import ARTIFACTS, INDEX, team_cluster
    from tests.helpers.gitrepo import commit_all
    from tests.helpers.s3 import moto_s3_server

    walls: dict[int, list[float]] = {n: [] for n in counts}
    sums: dict[int, list[float]] = {n: [] for n in counts}
    with moto_s3_server() as endpoint, tempfile.TemporaryDirectory(prefix="kiln-bench-shards-rig-") as tmp:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for bucket in (ARTIFACTS, INDEX):
            client.create_bucket(Bucket=bucket)
        with team_cluster(Path(tmp) / "rig", endpoint, {"kiln-build": 2, "kiln-gpu": 1}) as (made, project):
            _second_gpu_node(made)
            _with_suite(project, args.scale)
            commit_all(project, "the sharded suite", when="2026-12-01T00:00:00+00:00")
            wall, shard_s, runs = _nightly(made, endpoint, Path(tmp), full=False)  # records the durations
            print(f"warm-up (durations recorded): suite wall {wall:.1f} s, runs {runs}, tests {shard_s}", flush=True)
            for repeat in range(args.repeats):
                order = counts[repeat % len(counts):] + counts[:repeat % len(counts)]  # each count first in turn
                for n, shards in enumerate(order):
                    _set_shards(project, shards, f"2026-12-01T{repeat + 1:02d}:{n:02d}:00+00:00")
                    wall, shard_s, runs = _nightly(made, endpoint, Path(tmp))
                    walls[shards].append(wall)
                    sums[shards].append(sum(shard_s))
                    print(f"repeat {repeat + 1}, {shards} shard(s): suite wall {wall:.1f} s, runs {runs}, tests "
                          f"per shard {[round(t, 1) for t in shard_s]} s", flush=True)
        shutil.rmtree(Path(tmp) / "rig", ignore_errors=True)
    one = statistics.median(walls[1])
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    for shards in counts:
        print(f"{shards} shard(s): suite wall median {statistics.median(walls[shards]):.1f} s of "
              f"{[round(w, 1) for w in walls[shards]]}; tests' own seconds median "
              f"{statistics.median(sums[shards]):.1f}; ratio to 1 shard {statistics.median(walls[shards]) / one:.3f}")


if __name__ == "__main__":
    main()
