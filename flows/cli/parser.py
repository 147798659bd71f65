"""The ``kiln`` parser: every command, in the order ``kiln --help`` lists them, each added by its group's module."""

from __future__ import annotations

import argparse

from kiln.flows.cli import indexes, local, project, stages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="CI and release pipeline for GPU-kernel libraries, on Prefect."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (project.add_init, stages.add_nightly, stages.add_release, stages.add_build, stages.add_test,
                stages.add_bench, stages.add_publish, stages.add_prune, indexes.add_index, project.add_policies,
                indexes.add_verify, indexes.add_which, indexes.add_audit_abi, project.add_history,
                stages.add_bisect, project.add_quarantine, local.add_server, local.add_daemon):
        add(sub)
    return parser
