"""Prefect's cost per task run: a flow of N no-op units vs the same work without Prefect.

Each measurement is a fresh Python process (``--one``) so it sees exactly the
environment Kiln gives a command (``kiln.flows.local.environment`` defaults), and
talks to a real Prefect server on loopback: Kiln's local server
(:mod:`kiln.flows.local.server`) in a temporary ``PREFECT_HOME`` started for the
benchmark (or ``--api-url``). Three timings, in-process with
``time.perf_counter``, per repeat:

- ``plain``: the units' function called N times in a thread pool, no Prefect
  (the baseline: the same work without Prefect);
- ``flow``: one flow run whose N units are task runs submitted the way
  ``flows/build.py`` submits compile units (``with_options(task_run_name=…)
  .submit``, then ``wait``, then every result read), from the flow call to
  its return;
- ``empty``: the same flow with no units (the flow run's own fixed cost).

Per-task-run overhead = (flow − plain) / N; the marginal cost, without the
flow's fixed cost, is (flow − empty) / N. Each unit returns a small frozen
dataclass, like a compile unit's result.

Usage::

    python benchmarks/bench_overhead.py [--units 200] [--repeats 5] [--api-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Result:
    unit_id: str
    size: int


def work(unit_id: str) -> Result:
    return Result(unit_id, len(unit_id))


def plain(n: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, [f"unit-{i}" for i in range(n)]))
    assert len(results) == n
    return time.perf_counter() - start


def with_prefect(n: int) -> float:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.futures import wait

    from kiln.flows.run.common import retry_on_retryable

    unit_task = task(work, name="unit", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1,
                     retry_condition_fn=retry_on_retryable)

    @flow(name="overhead")
    def units_flow(count: int) -> int:
        futures = [unit_task.with_options(task_run_name=f"unit {i}").submit(f"unit-{i}") for i in range(count)]
        wait(futures)
        return sum(1 for f in futures if isinstance(f.result(raise_on_failure=False), Result))

    start = time.perf_counter()
    done = units_flow(n)
    elapsed = time.perf_counter() - start
    assert done == n, f"{done} of {n} units returned a result"
    return elapsed


def one(kind: str, n: int) -> dict:
    from kiln.flows.local.environment import apply_defaults

    apply_defaults()
    import_start = time.perf_counter()
    import prefect.flows  # noqa: F401 — paid once per command; reported, not counted in the flow
    import_s = time.perf_counter() - import_start
    seconds = plain(n) if kind == "plain" else with_prefect(n if kind == "flow" else 0)
    return {"kind": kind, "seconds": seconds, "import_s": import_s}


def measure(kind: str, n: int, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", kind, "--units", str(n)], capture_output=True,
                          text=True, timeout=1200, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace, env: dict[str, str]) -> dict:
    rows = []
    for _ in range(args.repeats):
        row = {kind: measure(kind, args.units, env) for kind in ("plain", "empty", "flow")}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    def med(kind: str) -> float:
        return statistics.median(r[kind]["seconds"] for r in rows)

    per_task = [(r["flow"]["seconds"] - r["plain"]["seconds"]) / args.units for r in rows]
    marginal = [(r["flow"]["seconds"] - r["empty"]["seconds"]) / args.units for r in rows]
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_before": args.load_before, "load_after": os.getloadavg(),
        "units": args.units, "repeats": args.repeats,
        "plain_s": med("plain"), "empty_flow_s": med("empty"), "flow_s": med("flow"),
        "per_task_ms": 1000 * statistics.median(per_task), "marginal_per_task_ms": 1000 * statistics.median(marginal),
        "prefect_import_s": statistics.median(r["flow"]["import_s"] for r in rows),
        "runs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--api-url", help="a running Prefect server (default: Kiln's local server in a temporary home)")
    parser.add_argument("--one", choices=("plain", "empty", "flow"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.units)))
        return
    args.load_before = os.getloadavg()
    sys.path.insert(0, str(REPO))
    if args.api_url:
        print(json.dumps(run(args, {**os.environ, "PREFECT_API_URL": args.api_url}), indent=2))
        return
    from kiln.flows.local.server import client_env, ensure_server, stop_pid

    with tempfile.TemporaryDirectory(prefix="kiln-bench-overhead-") as home:
        info = ensure_server(Path(home))
        try:
            env = {**os.environ, "PREFECT_HOME": home, **client_env(Path(home), info)}  # URL and auth string
            print(json.dumps(run(args, env), indent=2))
        finally:
            stop_pid(info.pid)


if __name__ == "__main__":
    main()
