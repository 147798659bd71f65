"""The ``kiln`` command line.

Each stage command runs its own Prefect flow; ``kiln index``, ``kiln verify``
and ``kiln policies`` need no Prefect server. Configuration is loaded and
validated before any flow starts, so a bad ``kiln.toml`` starts nothing.
Exit status: 0 when the flow completed, 1 when it ended Failed, 2 on bad
input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from flows.environment import apply_defaults

apply_defaults()  # before anything imports prefect

from release.errors import InvalidInputError, KilnError  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _add_config(parser: argparse.ArgumentParser, out_default: str | None = "out") -> None:
    parser.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    if out_default is not None:
        parser.add_argument("--out", default=out_default, help=f"run directory (default: {out_default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="CI and release pipeline for GPU-kernel libraries, on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("nightly", help="build, test, benchmark and publish the nightly")
    _add_config(p)

    p = sub.add_parser("release", help="the release flow: validate, build, test, bench, approve, publish, verify")
    _add_config(p, out_default="out/release")
    p.add_argument("--version", required=True, help="PEP 440 version to release")
    p.add_argument("--ref", default="HEAD", help="git ref being released")
    p.add_argument("--channel", default="release")
    p.add_argument("--dry-run", action="store_true", help="publish to a local staging copy and print the plan")
    p.add_argument("--yes", action="store_true", help="approve without pausing for the UI")
    p.add_argument("--allow-regressions", metavar="REASON", help="publish despite benchmark regressions (recorded)")

    p = sub.add_parser("build", help="build kernels and wheels for every variant")
    _add_config(p)
    p.add_argument("--version", help="version to build (default: nightly version of today)")
    p.add_argument("--variant", action="append", dest="variants", help="only this variant (repeatable)")

    p = sub.add_parser("test", help="run the test suites in isolated processes")
    _add_config(p)
    p.add_argument("--suite", action="append", dest="suites", help="only this suite (repeatable)")
    p.add_argument("--isolate", choices=("test", "file"), default="test")
    p.add_argument("--timeout", type=float, help="deadline per test in seconds (default: the suite's)")
    p.add_argument("--retries", type=int, default=1, help="retries of infrastructure failures")
    p.add_argument("--junit", help="also write JUnit XML here")
    p.add_argument("--json", dest="json_path", help="also write the JSON summary here")
    p.add_argument("--changed-since", help="run only suites whose dependencies changed since this git ref")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then arguments passed to pytest")

    p = sub.add_parser("bench", help="benchmark every kernel against its torch reference")
    _add_config(p, out_default=None)
    p.add_argument("--run-dir", default="out", help="run directory (default: out)")
    p.add_argument("--out", help="also write the results JSON here")
    p.add_argument("--compare", metavar="BASELINE", help="a results file, or 'last' for the previous stored run")
    p.add_argument("--size", choices=("small", "large"))
    p.add_argument("--metric", choices=("auto", "graph_replay", "eager", "cpu"), default="auto")

    p = sub.add_parser("publish", help="publish the run's wheels to an index")
    _add_config(p)
    p.add_argument("--to", dest="target", help="publish target name from kiln.toml")
    p.add_argument("--channel", choices=("nightly", "release"), default="nightly")
    p.add_argument("--dry-run", action="store_true")

    p = sub.add_parser("index", help="generate a PEP 503/691 index (no Prefect needed)")
    p.add_argument("wheel_dir", nargs="?", help="directory of wheels to index")
    p.add_argument("--from-list", help="JSON lines: filename, sha256, size, upload_time, ...")
    p.add_argument("--out", required=True, help="output directory")

    p = sub.add_parser("policies", help="write one least-privilege IAM policy per step")
    _add_config(p, out_default="policies")

    p = sub.add_parser("verify", help="check an index: links, hashes, sidecars; then install from it")
    p.add_argument("url")
    p.add_argument("--no-install", action="store_true", help="only check links and hashes")
    return parser


def _pytest_args(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


def _run_flow(flow: Callable[..., Any], run_dir: str | None, **params: Any) -> int:
    """Run ``flow``; print the summary of its units; map its final state to an exit status."""
    from flows.summary import print_summary

    state = flow(**params, return_state=True)
    if run_dir is not None:
        print_summary(Path(run_dir))
    if state.is_completed():
        return EXIT_OK
    print(f"\n{flow.name} ended {state.name}: {state.message}", file=sys.stderr)
    return EXIT_FAILED


def _dispatch(ns: argparse.Namespace) -> int:
    cmd = ns.command
    if cmd == "index":
        from release.cli import index_command

        if bool(ns.wheel_dir) == bool(ns.from_list):
            raise SystemExit("kiln index: give exactly one of WHEEL_DIR or --from-list FILE")
        return index_command(ns.wheel_dir, ns.from_list, ns.out)
    if cmd == "verify":
        from release.cli import verify_command

        return verify_command(ns.url, install=not ns.no_install)

    from tasks.config import load_config

    load_config(ns.config)  # validate before any flow starts: a bad config starts nothing
    if cmd == "policies":
        from flows.policies import policies_command

        return policies_command(ns.config, ns.out)
    if cmd == "nightly":
        from flows.nightly import nightly_flow

        return _run_flow(nightly_flow, ns.out, config_path=ns.config, out=ns.out)
    if cmd == "release":
        from flows.release import release_flow

        return _run_flow(
            release_flow, ns.out, version=ns.version, ref=ns.ref, channel=ns.channel, dry_run=ns.dry_run,
            allow_regressions=ns.allow_regressions, yes=ns.yes, config_path=ns.config, out=ns.out,
        )
    if cmd == "build":
        from flows.build import build_flow

        return _run_flow(build_flow, ns.out, config_path=ns.config, out=ns.out, version=ns.version, variants=ns.variants)
    if cmd == "test":
        from flows.test import test_flow

        return _run_flow(
            test_flow, ns.out, config_path=ns.config, out=ns.out, suites=ns.suites, isolate=ns.isolate,
            timeout=ns.timeout, retries=ns.retries, junit=ns.junit, json_path=ns.json_path,
            changed_since=ns.changed_since, pytest_args=_pytest_args(ns.pytest_args),
        )
    if cmd == "bench":
        from flows.bench import bench_flow

        return _run_flow(
            bench_flow, ns.run_dir, config_path=ns.config, out=ns.run_dir, compare=ns.compare, size=ns.size,
            metric=ns.metric, results_path=ns.out,
        )
    if cmd == "publish":
        from flows.publish import publish_flow

        return _run_flow(publish_flow, ns.out, config_path=ns.config, out=ns.out, target=ns.target,
                         channel=ns.channel, dry_run=ns.dry_run)
    raise SystemExit(f"unknown command {cmd!r}")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return _dispatch(ns)
    except KilnError as exc:
        print(f"kiln {ns.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidInputError) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
