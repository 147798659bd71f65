"""Sharding: the wall of one suite split into 1, 2 and 4 shards, against the sum of its tests' durations.

The suite is ``tests/fixtures/suites/sharded``: 40 tests that sleep 10 to 80 ms each, times ``--scale``
(default 10: 0.1 to 0.8 s, 18 s in all), in a tiny pure-Python project. Its wheel is built once (``test_flow``
without ``--run``); then every measured run is ``test_flow`` against that run's wheel, with every test run
(``--full``: nothing carried), the suite's ``shards`` set to 1, 2 or 4 in turn (interleaved, so load from other
jobs falls on all three alike). The shards are task runs of one flow run, concurrent on this machine, as
``kiln test`` runs them; each makes its own test environment and collects the suite on its own, which is part of
what a shard costs. A first run per count records the durations the partition then balances by.

Per run: **suite wall** — the slowest shard unit's duration (environment, collection and tests: the shards start
together); **flow wall** — the whole ``test_flow`` call (Prefect's task runs and the record included); **sum** — the
tests' own durations from the shard reports; **balance** — slowest / mean shard wall. Usage::

    python benchmarks/bench_shards.py [--runs 3] [--scale 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kiln.core.manifest import RunManifest
from kiln.flows.run.params import SuiteOptions

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "suites" / "sharded"
COUNTS = (1, 2, 4)

KILN_TOML = """
[project]
package = "pkg"
distribution = "pkg"
version = "1.0"
source = "pkg"
registry = "pkg.registry:registry"

[[variants]]
name = "cpu"
backend = "cpu"

[build]
jobs = 4

[[suites]]
name = "many"
paths = ["tests/many"]
shards = {shards}
pass_env = ["KILN_SHARD_SLEEP_SCALE"]

[publish]
default_target = "local"
[publish.targets.local]
url = "file://{{out}}/index"
"""


def _project(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    shutil.copytree(FIXTURE, root / "tests" / "many")
    (root / "kiln.toml").write_text(KILN_TOML.format(shards=1))
    return root / "kiln.toml"


def _measure(config: Path, out: Path, run_id: str | None, shards: int) -> dict[str, float | str]:
    from kiln.flows.test import test_flow

    config.write_text(KILN_TOML.format(shards=shards))
    start = time.perf_counter()
    state = test_flow(config_path=str(config), out=str(out), run_id=run_id, options=SuiteOptions(full=True),
                      return_state=True)
    flow_wall = time.perf_counter() - start
    if not state.is_completed():
        raise SystemExit(f"the suite did not pass with {shards} shard(s): {state.message}")
    # With --run every measurement records into the built run: this count's units and reports are its own.
    run = RunManifest.load(out / (run_id or str(state.state_details.flow_run_id)))
    names = ["many.cpu"] if shards == 1 else [f"many.cpu.shard-{i}-of-{shards}" for i in range(1, shards + 1)]
    ids = {"test/many/cpu"} if shards == 1 else {f"test/many/cpu/shard-{i}-of-{shards}" for i in range(1, shards + 1)}
    walls = [u.duration_s for u in run.units if u.id in ids]
    tests = 0.0
    for name in names:
        tests += sum(t["duration_s"] for t in json.loads((run.root / "tests" / f"{name}.json").read_text())["tests"])
    return {"run": run.run_id, "suite": max(walls), "flow": flow_wall, "sum": tests,
            "balance": max(walls) / statistics.mean(walls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ["KILN_SHARD_SLEEP_SCALE"] = f"{args.scale:g}"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=600):  # one throwaway API server, as the tests use
        _bench(args.runs)


def _bench(runs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-shards-"))
    os.chdir(work)  # as `kiln test` runs: from beside the project, not from Kiln's own checkout
    config, out = _project(work / "proj"), work / "out"
    built = str(_measure(config, out, None, 1)["run"])  # builds the wheel; records the durations
    for shards in COUNTS[1:]:
        _measure(config, out, built, shards)  # warm: each count's environments made once
    found: dict[int, list[dict[str, float | str]]] = {n: [] for n in COUNTS}
    for n in range(runs):
        for shards in COUNTS if n % 2 == 0 else tuple(reversed(COUNTS)):
            found[shards].append(_measure(config, out, built, shards))
            print(f"run {n + 1}, {shards} shard(s): " + ", ".join(
                f"{k} {v:.2f}" for k, v in found[shards][-1].items() if isinstance(v, float)), flush=True)
    base = statistics.median(float(r["suite"]) for r in found[1])
    print("\n| shards | suite wall s (median) | flow wall s | sum of test durations s | wall / sum | "
          "wall / 1 shard | balance (slowest / mean) |")
    print("|---|---|---|---|---|---|---|")
    for shards, rows in found.items():
        def med(key: str, rows: list[dict[str, float | str]] = rows) -> float:
            return statistics.median(float(r[key]) for r in rows)
        print(f"| {shards} | {med('suite'):.2f} | {med('flow'):.2f} | {med('sum'):.2f} | "
              f"{med('suite') / med('sum'):.2f} | {med('suite') / base:.2f} | {med('balance'):.2f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
