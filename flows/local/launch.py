"""The ``kiln`` console script: a flow command runs in Kiln's daemon when one is warm, else here.

Only the standard library and :mod:`kiln.flows.local.daemon` are imported before
that choice, so a command the daemon runs never pays for importing Prefect.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from kiln.core import identity
from kiln.core.sandbox import seal_environ
from kiln.flows.local import daemon
from kiln.flows.local.environment import apply_defaults


def _command(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main() -> NoReturn:
    seal_environ()  # the step's credentials in this environment: not readable through /proc by other processes
    identity.hold()  # the CI's OIDC identity: out of the environment every child inherits, until an upload needs it
    apply_defaults()  # before the daemon's key: the daemon imported Prefect under these defaults
    argv = sys.argv[1:]
    if daemon.enabled() and _command(argv) in daemon.FLOW_COMMANDS:
        status = daemon.run(argv)
        if status is not None:
            sys.exit(status)
    from kiln.flows.cli import main as cli_main

    cli_main()
    raise AssertionError("kiln.flows.cli.main() ends the process")
