"""Warm ``kiln build`` of one commit's Kiln (A) against the working tree's (B), interleaved, as Kiln's daemon runs it.

A warm build's time moves by seconds from one minute to the next on a shared machine, so a change is judged
by builds of A and B taken in turns under the same load. Each side is one long-lived process that imports
Kiln, Prefect and the flows as the daemon does (``daemon_server._load``), freezes the heap and then forks a
child per build that runs ``kiln build --config CONFIG --out OUT`` (what the daemon's child runs; no client
start-up or socket). A's process loads Kiln from a tree of ``git archive REV`` (its sources replace the
editable install's mapping before anything of Kiln is imported); B's from this checkout. Both build the same
project into the same build cache, so both are warm after the first pair. Before each build the benchmark
waits until Kiln's local Prefect server is quiet (as ``bench_build.py --quiet-server`` does).

Usage (Kiln's local server up, the project built once already)::

    python benchmarks/bench_warm_ab.py --base HEAD~3 --config /tmp/p/kiln.toml --out /tmp/p/out --pairs 6
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("core", "flows", "tasks", "release")


def serve(root: str, config: str, out: str) -> None:
    """One side: import as the daemon does, then one forked build per line read from stdin."""
    import __editable___kiln_0_1_0_finder as finder  # the editable install's mapping: kiln.<part> -> folder

    for part in PARTS:
        finder.MAPPING[f"kiln.{part}"] = f"{root}/{part}"
    from kiln.flows.local import daemon_server
    from kiln.flows.local.environment import apply_defaults

    apply_defaults()
    entry = daemon_server._load("kiln.flows.cli:main")
    gc.collect()
    gc.freeze()
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            status = entry(["build", "--config", config, "--out", out])
            threading._shutdown()  # type: ignore[attr-defined]  # as the daemon's child ends
            atexit._run_exitfuncs()
            os._exit(status)
        _, status = os.waitpid(pid, 0)
        print(f"{time.perf_counter() - start:.3f} {status}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose Kiln is A")
    parser.add_argument("--config", help="the project's kiln.toml (required)")
    parser.add_argument("--out", help="the builds' --out (required)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    if not args.config or not args.out:
        parser.error("--config and --out are required")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_build import server_pid, wait_quiet

    pid = server_pid()
    with tempfile.TemporaryDirectory(prefix="kiln-ab-") as base:
        archive = subprocess.run(["git", "archive", args.base, *PARTS], cwd=REPO, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True)
        sides = {name: subprocess.Popen([sys.executable, __file__, "--serve", root, args.config, args.out],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=base)
                 for name, root in (("A", base), ("B", str(REPO)))}
        for side in sides.values():
            assert side.stdout is not None and side.stdout.readline().strip() == "ready"
        times: dict[str, list[float]] = {"A": [], "B": []}
        for pair in range(args.pairs):
            for name in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                wait_quiet(pid)
                side = sides[name]
                assert side.stdin is not None and side.stdout is not None
                side.stdin.write("build\n")
                side.stdin.flush()
                seconds, status = side.stdout.readline().split()
                if status != "0":
                    raise SystemExit(f"{name}'s build failed (wait status {status})")
                times[name].append(float(seconds))
            print(json.dumps({"pair": pair, "A": times["A"][-1], "B": times["B"][-1], "load": os.getloadavg()[0]}),
                  file=sys.stderr)
        for side in sides.values():
            assert side.stdin is not None
            side.stdin.close()
            side.wait()
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(json.dumps({"base": args.base, "A_s": times["A"], "B_s": times["B"], "A_median_s": a, "B_median_s": b,
                      "A_over_B": round(a / b, 2)}, indent=1))


if __name__ == "__main__":
    main()
