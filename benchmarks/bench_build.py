"""Build-stage benchmarks: cold build vs warm rebuild, and 2 compile workers vs 1.

The project is copied first (a snapshot), then each measurement runs in a fresh Python process
(``--one``), so a cold build
pays for everything a CI job pays for: worker start-up, Triton and the
kernel package's imports, every compile, the nvcc build, the wheels. A cold
build gets an empty cache and an empty Triton cache; a warm rebuild reuses
the cache the cold build just filled. Two timings are reported per run:

- ``build``: planning done, units built, wheels written (``time.perf_counter``
  inside the process, from after the registry is loaded to the last wheel);
- ``process``: the whole subprocess, interpreter start and imports included.

``--cli`` measures what a user times instead: ``kiln build --out DIR`` of the
snapshot, process start to exit, with Kiln's local Prefect server already
running (started first if it is not) and Kiln's daemon for the directory
(started first). Each repeat is one cold build (the snapshot's build cache
and stored plans deleted) followed by ``--warm-runs`` warm builds in the
daemon and as many without it (``KILN_DAEMON=off``: the baseline, measured
in the same run), alternating; the summary gives the medians and each
cold / warm ratio. ``--no-daemon`` runs every build without the daemon. With
``--quiet-server`` each build first waits until the server has stored the
previous run's events (its CPU under 10 % over 2 s, at most 120 s; the waits
are reported), as a build run after the server caught up.

Usage::

    python benchmarks/bench_build.py [--config kiln.toml] [--repeats 3]
    python benchmarks/bench_build.py --cli [--repeats 1] [--warm-runs 5] [--quiet-server] [--no-daemon]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def one(config: str, cache: str, out: str, jobs: int) -> dict:
    """One build in this process; returns its timings and cache counts."""
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import build_unit

    setup = prepare_build(config, "0.1.0", None, cache_dir=cache)
    start = time.perf_counter()
    outcomes = {}
    with compile_context(setup, out, jobs=jobs) as env, ThreadPoolExecutor(jobs) as threads:
        results = threads.map(lambda u: (u.id, build_unit(u, env)), setup.plan.units)
        outcomes.update(results)
    for variant in setup.plan.variants:
        assemble_variant(setup, variant, outcomes, out)
    build_s = time.perf_counter() - start
    caches = [r.cache for r in outcomes.values()]
    return {"build_s": build_s, "units": len(caches), "hits": caches.count("hit"), "misses": caches.count("miss")}


def snapshot(config_path: Path, dest: Path) -> str:
    """Copy the project (kiln.toml, its package, empty suite dirs) so edits made
    to the working tree while the benchmark runs cannot turn warm runs cold."""
    from kiln.tasks.project.config import load_config

    config = load_config(config_path)
    dest.mkdir(parents=True)
    shutil.copy2(config_path, dest / config_path.name)
    source = config.project.source
    shutil.copytree(config.path(source), dest / source, ignore=shutil.ignore_patterns("__pycache__", "_aot", "*.so"))
    for suite in config.suites:
        for path in suite.paths:
            (dest / path).mkdir(parents=True, exist_ok=True)
    if config.publish.pins:  # kiln.toml must name existing paths to load
        (dest / config.publish.pins).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(config.path(config.publish.pins), dest / config.publish.pins)
    return str(dest / config_path.name)


def measure(config: str, cache: Path, out: Path, jobs: int) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            "--config",
            config,
            "--cache",
            str(cache),
            "--out",
            str(out),
            "--jobs",
            str(jobs),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        cwd=REPO,
    )
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"build failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "process_s": process_s}


def kiln_command() -> list[str]:
    """The ``kiln`` console script beside this interpreter (what a user runs), else the module."""
    script = Path(sys.executable).parent / "kiln"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kiln.flows.cli"]


def server_pid() -> int:
    """The pid of Kiln's local Prefect server, started if it is not running."""
    subprocess.run([*kiln_command(), "server", "start"], check=True, timeout=900, capture_output=True)
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    return int(json.loads((home / "kiln-server.json").read_text())["pid"])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, limit_s: float = 120.0) -> float:
    """Seconds waited until the server used under 10 % of a core over 2 s (or ``limit_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        before = cpu_seconds(pid)
        time.sleep(2.0)
        if cpu_seconds(pid) - before < 0.2:
            break
    return time.monotonic() - start


def time_cli_build(config: str, out: Path, daemon: bool) -> float:
    """Seconds of one ``kiln build --out OUT`` process, start to exit (in Kiln's daemon or not)."""
    env = {**os.environ, "KILN_DAEMON": "auto" if daemon else "off"}
    start = time.perf_counter()
    proc = subprocess.run([*kiln_command(), "build", "--config", config, "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=REPO, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"kiln build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def start_daemon(config: str) -> None:
    """Have Kiln's daemon for this directory running (a flow command with a bad config starts one)."""
    env = {**os.environ, "KILN_DAEMON": "auto"}
    probe = [*kiln_command(), "build", "--config", str(Path(config).with_name("no-such.toml"))]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        subprocess.run(probe, capture_output=True, timeout=600, cwd=REPO, env=env)
        status = subprocess.run([*kiln_command(), "daemon", "status"], capture_output=True, text=True,
                                timeout=600, cwd=REPO, env=env)
        if status.returncode == 0:
            return
        time.sleep(1.0)
    raise SystemExit("Kiln's daemon did not start within 300 s")


def cli_main(args: argparse.Namespace) -> None:
    """Cold then warm ``kiln build`` processes of one snapshot, with the local Prefect server up.

    Each repeat: one cold build (in the daemon unless ``--no-daemon``), then ``--warm-runs`` warm builds
    in Kiln's daemon and as many with ``KILN_DAEMON=off`` (the baseline, in the same run), alternating.
    """
    pid, load_start, rows = server_pid(), os.getloadavg(), []
    quiet = (lambda: round(wait_quiet(pid), 1)) if args.quiet_server else (lambda: 0.0)
    use_daemon = not args.no_daemon
    modes = ("daemon", "off") if use_daemon else ("off",)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-cli-") as tmp:
        config = snapshot(Path(args.config), Path(tmp) / "project")
        if use_daemon:
            start_daemon(config)
        for run in range(args.repeats):
            shutil.rmtree(Path(tmp) / "project" / ".kiln", ignore_errors=True)  # build cache and stored plans
            waited = [quiet()]
            out = Path(tmp) / f"out-{run}"
            cold = time_cli_build(config, out, use_daemon)
            warm: dict[str, list[float]] = {"daemon": [], "off": []}
            for _ in range(args.warm_runs):
                for mode in modes:
                    waited.append(quiet())
                    warm[mode].append(round(time_cli_build(config, out, mode == "daemon"), 3))
            rows.append({"cold_s": round(cold, 3), "warm_s": warm, "waited_s": waited})
            print(json.dumps(rows[-1]), file=sys.stderr)
    cold_all = [r["cold_s"] for r in rows]
    summary: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_start_end": [load_start, os.getloadavg()],
        "command": " ".join([*kiln_command(), "build", "--out", "DIR"]),
        "cold_process_s": statistics.median(cold_all), "cold_in_daemon": use_daemon,
    }
    for mode in modes:
        warm_all = [w for r in rows for w in r["warm_s"][mode]]
        summary[f"warm_{mode}_process_s"] = statistics.median(warm_all)
        summary[f"warm_{mode}_vs_cold"] = statistics.median(cold_all) / statistics.median(warm_all)
    summary["runs"] = rows
    print(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "kiln.toml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache")
    parser.add_argument("--out")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cli", action="store_true", help="time whole `kiln build` processes, cold then warm")
    parser.add_argument("--warm-runs", type=int, default=5, help="with --cli: warm builds after each cold one")
    parser.add_argument("--no-daemon", action="store_true",
                        help="with --cli: every build with KILN_DAEMON=off (no daemon runs)")
    parser.add_argument("--quiet-server", action="store_true",
                        help="with --cli: before each build, wait until the server has digested the last one's events")
    args = parser.parse_args()
    if args.cli:
        cli_main(args)
        return
    if args.one:
        print(json.dumps(one(args.config, args.cache, args.out, args.jobs)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-build-") as tmp:
        config = snapshot(Path(args.config), Path(tmp) / "project")
        for run in range(args.repeats):
            base = Path(tmp) / str(run)
            cold2 = measure(config, base / "cache2", base / "out-cold2", 2)
            warm2 = measure(config, base / "cache2", base / "out-warm2", 2)
            cold1 = measure(config, base / "cache1", base / "out-cold1", 1)
            rows.append({"cold2": cold2, "warm2": warm2, "cold1": cold1})
            print(json.dumps(rows[-1]), file=sys.stderr)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in rows)

    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats,
        "units": rows[0]["cold2"]["units"],
        "warm_hits": rows[0]["warm2"]["hits"],
        "cold_build_s": med("cold2", "build_s"), "warm_build_s": med("warm2", "build_s"),
        "cold_process_s": med("cold2", "process_s"), "warm_process_s": med("warm2", "process_s"),
        "cold_1job_build_s": med("cold1", "build_s"),
        "warm_vs_cold_build": statistics.median(r["cold2"]["build_s"] / r["warm2"]["build_s"] for r in rows),
        "warm_vs_cold_process": statistics.median(r["cold2"]["process_s"] / r["warm2"]["process_s"] for r in rows),
        "speedup_2_vs_1": statistics.median(r["cold1"]["build_s"] / r["cold2"]["build_s"] for r in rows),
        "runs": rows,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
