"""The commands about the project and what its runs stored: init, policies, history and quarantine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.core.errors import EXIT_FAILED, EXIT_OK
from kiln.flows.cli.args import Commands, add_config, runs, runs_with_config
from kiln.tasks.project.config import KilnConfig


def add_init(sub: Commands) -> None:
    p = sub.add_parser("init", help="inspect a package's repository and write the kiln.toml that builds it",
                       description="Read the package's build files (never run them) and write its kiln.toml.",
                       epilog="exit status: 0 written; 1 written, but its build names native sources the tree does"
                       " not hold (every build would fail: the file's header and stderr name them); 2 nothing"
                       " written (the message says why). Values it had to assume are said on stderr. --check: 0 the"
                       " kiln.toml agrees with the build, 1 it does not (each line says the key to change).")
    p.add_argument("directory", nargs="?", default=".", help="the package's repository (default: here)")
    p.add_argument("--check", action="store_true", help="write nothing: say where the repository's kiln.toml"
                   " disagrees with what its build reads (exit status 1 where it does)")
    runs(p, lambda ns: _init_check_command(ns.directory) if ns.check else _init_command(ns.directory))


def add_policies(sub: Commands) -> None:
    p = sub.add_parser("policies", help="write one least-privilege IAM policy per step")
    add_config(p, out_default="policies")
    runs_with_config(p, _policies_command)


def add_history(sub: Commands) -> None:
    p = sub.add_parser("history", help="the benchmark history the nightlies stored, by commit")
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    p.add_argument("--kernel", help="only this kernel")
    p.add_argument("--case", help="only this case (e.g. n4096)")
    p.add_argument("--variant", help="the variant whose runs to show (default: the newest stored run's)")
    p.add_argument("--metric", choices=("graph_replay", "eager", "cpu"),
                   help="the decision metric (default: the newest stored run's)")
    p.add_argument("--limit", type=int, default=30, help="at most this many runs, the newest (default: 30)")
    p.add_argument("--plot", type=Path, help="also write the trend plot (PNG) here")
    runs_with_config(p, _history_command)


def add_quarantine(sub: Commands) -> None:
    p = sub.add_parser("quarantine", help="the flaky tests in quarantine ([testing.quarantine]): they run and are "
                                          "reported, and do not gate publishing")
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    runs_with_config(p, _quarantine_command)


def _init_command(directory: str) -> int:
    from kiln.tasks.onboarding import init_project

    result = init_project(directory)
    print(f"kiln init: {result.findings.distribution} is a {result.findings.kind} package; inferred:")
    for reason in result.findings.reasons:
        print(f"  - {reason}")
    for field, others in result.findings.undecided:  # never a silent guess: the file holds a commented choice
        written = getattr(result.findings, field)
        print(f"kiln init: could not decide the {field}: wrote {written!r}, also {', '.join(map(repr, others))};"
              f" pick one in {result.path} (its [project] {field} line lists them)", file=sys.stderr)
    for value in result.findings.assumed:  # never a silent guess: the header says it too
        print(f"kiln init: assumed {value}", file=sys.stderr)
    if result.findings.missing_sources:
        print(f"kiln init: warning: its build names native sources {result.path.parent} does not hold:"
              f" {', '.join(result.findings.missing_sources)}; every build of it fails until they are there"
              " (an sdist whose MANIFEST.in left them out?)", file=sys.stderr)
    print(f"wrote {result.path}; next: git add kiln.toml, then kiln nightly")
    return EXIT_FAILED if result.findings.missing_sources else EXIT_OK


def _init_check_command(directory: str) -> int:
    from kiln.tasks.onboarding.check import check_project

    lines = check_project(directory)
    for line in lines:
        print(f"kiln init --check: {line}")
    if not lines:
        print("kiln init --check: kiln.toml agrees with what the build reads")
    return EXIT_FAILED if lines else EXIT_OK


def _policies_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.cli.policies import write_policies

    return write_policies(config, ns.out)


def _history_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.cli.history import show_history

    print(show_history(config, kernel=ns.kernel, case=ns.case, variant=ns.variant, metric=ns.metric,
                       limit=ns.limit, plot=ns.plot), end="")
    return EXIT_OK


def _quarantine_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.cli.quarantine import show_quarantine

    print(show_quarantine(config), end="")
    return EXIT_OK
