"""The commands that run a stage of the pipeline as its own flow: nightly, release, build, test, bench, publish,
prune and bisect."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from kiln.core.errors import EXIT_OK
from kiln.flows.cli.args import Commands, Renamed, add_config, add_run, runs_with_config
from kiln.flows.cli.flowrun import print_result, run_flow
from kiln.tasks.bench.results import MetricChoice
from kiln.tasks.project.config import BENCH_SIZES, CHANNELS, KilnConfig
from kiln.tasks.testing.jobs import ISOLATIONS


def add_nightly(sub: Commands) -> None:
    p = sub.add_parser("nightly", help="build, test, benchmark and publish the nightly")
    add_config(p)
    p.add_argument("--full", action="store_true", help="run every test: none is carried from an earlier run "
                   "([testing.selection]); a full run also checks that selection missed no failure")
    runs_with_config(p, _nightly_command, flow=True, head_start="nightly")


def add_release(sub: Commands) -> None:
    p = sub.add_parser("release", help="the release flow: validate, build, test, bench, approve, publish, verify")
    add_config(p)
    runs_with_config(p, _release_command, flow=True, head_start="release")
    p.add_argument("--version", required=True, help="PEP 440 version to release")
    p.add_argument("--ref", default="HEAD", help="git ref being released")
    p.add_argument("--channel", default="release")
    p.add_argument("--dry-run", action="store_true", help="publish to a local staging copy and print the plan")
    p.add_argument("--yes", action="store_true",
                   help="approve here instead of pausing for approval in the Prefect UI (command line only)")
    p.add_argument("--allow-regressions", metavar="REASON",
                   help="publish despite benchmark regressions that would block; the reason is recorded")
    p.add_argument("--from-run", metavar="RUN",
                   help="promote this completed nightly's tested wheels under --version instead of building"
                        " (binaries unchanged, checked by hash; the release's record names the run)")


def add_build(sub: Commands) -> None:
    p = sub.add_parser("build", help="build kernels and wheels for every variant")
    add_config(p)
    runs_with_config(p, _build_command, flow=True, head_start="build")
    p.add_argument("--version", help="version to build (default: the commit's nightly version, "
                                     "<base>.dev<commit time as YYYYMMDDHHMMSS>)")
    p.add_argument("--variant", action="append", dest="variants", help="only this variant (repeatable)")
    p.add_argument("--witness", action="store_true",
                   help="build every wheel again with every cache bypassed and fail unless each is byte-identical")


def add_test(sub: Commands) -> None:
    p = sub.add_parser("test", help="run the test suites in isolated processes")
    add_config(p)
    runs_with_config(p, _test_command, flow=True)
    p.add_argument("--suite", action="append", dest="suites", help="only this suite (repeatable)")
    p.add_argument("--isolate", choices=ISOLATIONS, default="test")
    p.add_argument("--timeout", type=float, help="deadline per test in seconds (default: the suite's)")
    p.add_argument("--retries", type=int, default=1, help="retries of infrastructure failures")
    p.add_argument("--junit", help="also write JUnit XML here")
    p.add_argument("--json", dest="json_path", help="also write the JSON summary here")
    p.add_argument("--changed-since", help="run only suites whose dependencies changed since this git ref")
    p.add_argument("--full", action="store_true", help="run every test: none is carried from an earlier run "
                   "([testing.selection])")
    p.add_argument("--explain", action="store_true", help="run nothing: print, per test of each suite's newest "
                   "record, whether the next run runs or carries it and why (against the --run's wheels)")
    p.add_argument("--selection-on", metavar="SUITE", help="run nothing: turn test selection back on for SUITE "
                   "after a recall check turned it off")
    add_run(p, "test the wheels")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="-- then test paths or node ids, run as one ad-hoc suite instead of the configured ones "
                        "(each test isolated as usual), and options for pytest (-k EXPR, -x)")


def add_bench(sub: Commands) -> None:
    p = sub.add_parser("bench", help="benchmark every kernel against its torch reference")
    add_config(p, out_default=None)
    runs_with_config(p, _bench_command, flow=True)
    p.add_argument("--run-dir", default="out", help="run directory (default: out)")
    p.add_argument("--results", dest="results_path", metavar="FILE", help="also write the results JSON here")
    p.add_argument("--out", dest="results_path", metavar="FILE", action=Renamed, new="--results",
                   help="deprecated spelling of --results (every other command's --out is a folder)")
    p.add_argument("--compare", metavar="BASELINE", help="a results file, or 'last' for the previous stored run")
    p.add_argument("--size", choices=BENCH_SIZES)
    p.add_argument("--metric", choices=get_args(MetricChoice), default="auto")
    add_run(p, "benchmark the wheel")


def add_publish(sub: Commands) -> None:
    p = sub.add_parser("publish", help="publish the run's wheels to an index")
    add_config(p)
    runs_with_config(p, _publish_command, flow=True)
    p.add_argument("--to", dest="target", help="publish target name from kiln.toml")
    p.add_argument("--channel", choices=CHANNELS, default="nightly")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--run", dest="run_id", metavar="ID", default="latest",
                   help="publish the wheels of this run (a run id, or 'latest', the default: the newest run "
                        "that built wheels)")


def add_prune(sub: Commands) -> None:
    p = sub.add_parser("prune", help="apply [publish.retention] to a nightly channel: yank older nightlies, "
                                     "remove them after the grace period")
    add_config(p)
    runs_with_config(p, _prune_command, flow=True)
    p.add_argument("--to", dest="target", help="publish target name from kiln.toml (default: the default target)")
    p.add_argument("--channel", choices=CHANNELS, default="nightly")
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")


def add_bisect(sub: Commands) -> None:
    p = sub.add_parser("bisect", help="the first commit where a test fails or a benchmark got slower, "
                                      "from the wheels runs stored")
    p.add_argument("--good", required=True, help="a commit (any git ref) where the test passes")
    p.add_argument("--bad", required=True, help="a later commit where it fails")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--test", metavar="NODEID", help="the pytest node id, e.g. tests/test_x.py::test_y")
    mode.add_argument("--bench", metavar="KERNEL[/CASE]",
                      help="the benchmark: the first commit slower than --good beyond the threshold and the noise")
    p.add_argument("--variant", default="cpu", help="whose wheel to install (default: cpu)")
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    runs_with_config(p, _bisect_command, flow=True)


def _nightly_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.nightly import nightly_flow

    return run_flow(nightly_flow, ns.out, config_path=ns.config, out=ns.out, full=ns.full)


def _release_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.release import approved_release_flow, release_flow

    # --yes picks the flow approved on the command line: the deployment's form has no such toggle.
    return run_flow(
        approved_release_flow if ns.yes else release_flow, ns.out, version=ns.version, ref=ns.ref,
        channel=ns.channel, dry_run=ns.dry_run, allow_regressions=ns.allow_regressions, config_path=ns.config,
        out=ns.out, from_run=ns.from_run,
    )


def _build_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.build import build_flow

    return run_flow(build_flow, ns.out, config_path=ns.config, out=ns.out, version=ns.version, variants=ns.variants,
                    witness=ns.witness)


def _pytest_args(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


def _test_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.run.params import SuiteOptions
    from kiln.flows.test import test_flow
    from kiln.tasks.testing.suite import split_test_args

    if ns.explain or ns.selection_on:
        from kiln.flows.cli.selection import explain_selection, selection_on

        print(selection_on(config, ns.selection_on) if ns.selection_on
              else explain_selection(config, ns.suites, ns.run_id, ns.out, full=ns.full), end="")
        return EXIT_OK
    # `-- PATHS` run as one ad-hoc suite; options after `--` (-k, -x) go to pytest.
    paths, pytest_args = split_test_args(_pytest_args(ns.pytest_args), Path.cwd(), config.root)
    options = SuiteOptions(isolate=ns.isolate, timeout=ns.timeout, retries=ns.retries, pytest_args=pytest_args,
                           junit=ns.junit, json_path=ns.json_path, full=ns.full)
    return run_flow(test_flow, ns.out, config_path=ns.config, out=ns.out, suites=ns.suites, options=options,
                    changed_since=ns.changed_since, paths=paths or None, run_id=ns.run_id)


def _bench_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.bench import bench_flow

    return run_flow(
        bench_flow, ns.run_dir, config_path=ns.config, out=ns.run_dir, compare=ns.compare, size=ns.size,
        metric=ns.metric, results_path=ns.results_path, run_id=ns.run_id,
    )


def _publish_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.publish import publish_flow

    return run_flow(publish_flow, ns.out, config_path=ns.config, out=ns.out, target=ns.target,
                    channel=ns.channel, dry_run=ns.dry_run, run_id=ns.run_id)


def _prune_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.prune import prune_flow
    from kiln.flows.run.common import sync_state

    return print_result("prune", sync_state(prune_flow(config_path=ns.config, channel=ns.channel, target=ns.target,
                                                       dry_run=ns.dry_run, out=ns.out, return_state=True)))


def _bisect_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.bisect import bisect_flow
    from kiln.flows.run.common import sync_state

    return print_result("bisect", sync_state(bisect_flow(good=ns.good, bad=ns.bad, test=ns.test, bench=ns.bench,
                                                         config_path=ns.config, variant=ns.variant,
                                                         return_state=True)))
