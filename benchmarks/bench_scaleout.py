"""The same nightly on one worker versus three: wall time, and the cost of dispatching a unit.

Both clusters are built by the docs' "Scaling out" recipe (docs/guides/scale-out.md) on loopback
(PostgreSQL, a Prefect server on it, moto's S3 server as artifact store and
publish target; tests/helpers/cluster.py), with the ``acme`` fixture project
and the same nightly: two variant builds, a CPU suite, a GPU suite on a
simulated GPU node, publishing.

- ``one``: a single worker, on the CPU pool, runs everything. The project's
  ``[pools] build`` names the CPU pool, which has no build deployment, so
  the nightly builds in its own process (on that worker, as on one
  machine); the suites and the publish are dispatched to the same worker;
- ``three``: a build worker, a CPU worker and a GPU worker, each on its own
  pool; every build, suite and publish is dispatched.

The GPU suite runs on the CPU pool in ``one`` and on the GPU pool in
``three``, its worker simulating one GPU either way. Per nightly the script records the wall time from the deployment
run to its final state, and for every dispatched unit the time from its
creation (``run_deployment``) to its worker starting it (Running). Each
configuration runs ``--repeats`` nightlies one after the other on a fresh
cluster; the median is reported.

Usage::

    python benchmarks/bench_scaleout.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.cluster import ARTIFACTS, INDEX, team_cluster, trigger
from tests.helpers.s3 import moto_s3_server

CONFIGS = {
    # the project's [pools], workers per pool, the commit time (each configuration's own nightly version)
    "one": ('[pools]\nbuild = "kiln-process"\ncpu = "kiln-process"\ndeadline_s = 900\n',
            {"kiln-build": 0, "kiln-process": 1, "kiln-gpu": 0}, "2026-11-30T21:00:01+00:00"),
    "three": ('[pools]\nbuild = "kiln-build"\ncpu = "kiln-process"\ndeadline_s = 900\n',
              {"kiln-build": 1, "kiln-process": 1, "kiln-gpu": 1}, "2026-11-30T21:00:02+00:00"),
}


def _dispatch_delays(made, run_id: str) -> list[float]:
    with made.client() as client:
        runs = [r for r in client.read_flow_runs(limit=200)
                if r.parameters.get("run_id") == run_id and r.deployment_id is not None]
    return [(r.start_time - r.created).total_seconds() for r in runs if r.start_time and r.created]


def _one_config(name: str, repeats: int, tmp: Path, endpoint: str) -> dict:
    pools, workers, when = CONFIGS[name]
    walls, delays, states = [], [], []
    gpu_pool = "kiln-process" if name == "one" else "kiln-gpu"
    with team_cluster(tmp / name, endpoint, workers, pools=pools, gpu_pool=gpu_pool,
                      when=when) as (made, _project):
        for _ in range(repeats):
            start = time.monotonic()
            run_id = trigger(made)
            final = made.wait_final(run_id, 1800)
            walls.append(time.monotonic() - start)
            states.append(f"{final.state.type.value}: {final.state.message}")
            delays += _dispatch_delays(made, run_id)
    return {"walls_s": walls, "median_wall_s": statistics.median(walls), "states": states,
            "dispatched_units": len(delays),
            "median_dispatch_to_start_s": statistics.median(delays) if delays else None,
            "max_dispatch_to_start_s": max(delays) if delays else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append", help="run only these configurations")
    args = parser.parse_args()
    import boto3

    results: dict = {"machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}"}
    with moto_s3_server() as endpoint, tempfile.TemporaryDirectory(prefix="kiln-bench-scaleout-") as tmp:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for bucket in (ARTIFACTS, INDEX):
            client.create_bucket(Bucket=bucket)
        for name in args.only or CONFIGS:
            results[name] = _one_config(name, args.repeats, Path(tmp), endpoint)
            print(name, json.dumps(results[name]), flush=True)
    if "one" in results and "three" in results:
        results["ratio_one_over_three"] = results["one"]["median_wall_s"] / results["three"]["median_wall_s"]
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
