"""``kiln``'s entry: parse, load kiln.toml once, run the command's handler, and map what it ended with to an exit
status."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn, cast

from kiln.core.errors import KilnError
from kiln.flows.cli.args import ConfigHandler, PlainHandler
from kiln.flows.cli.flowrun import connect, verbosity
from kiln.flows.cli.parser import build_parser
from kiln.tasks.project.config import KilnConfig


def _dispatch(ns: argparse.Namespace) -> int:
    """Run the subcommand's handler; a flow command under its signals, connected to a server.

    The project's kiln.toml is loaded here, once, before any flow starts (a bad config starts nothing),
    and handed to the handler.
    """
    if ns.config_handler is None:
        return cast(PlainHandler, ns.handler)(ns)
    from kiln.tasks.project.config import load_config

    config = load_config(ns.config)
    handler = cast(ConfigHandler, ns.config_handler)
    if not ns.connect:
        return handler(ns, config)
    from kiln.flows.run import cancel

    # From here one SIGTERM or Ctrl-C cancels the command: its flow run ends Cancelled, what it started ends.
    with cancel.command_signals(), verbosity(ns.verbose):
        return cancel.cancelled_status(ns.command, lambda: _connected(handler, ns, config))


def _connected(handler: ConfigHandler, ns: argparse.Namespace, config: KilnConfig) -> int:
    with connect(lambda: _head_start(ns, config)):
        return handler(ns, config)


def _head_start(ns: argparse.Namespace, config: KilnConfig) -> None:
    if ns.head_start is not None:
        from kiln.flows.run import headstart

        getattr(headstart, ns.head_start)(ns, config)


def _exit_now(status: int) -> NoReturn:
    """End the process as the interpreter would, without its teardown.

    After the last line of output, Python's own exit frees every module and
    object (Prefect, pydantic, and torch when a stage imported it): 0.5-1.2 s
    of a warm build that nothing depends on. What exit does that matters is
    done here, in its order: threading's shutdown (Prefect drains its log and
    event workers to the server there, then the non-daemon threads are
    joined), the atexit handlers (the event loop thread, ``logging.shutdown``),
    and flushing stdout and stderr.
    """
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first
    if shutdown is None:  # another interpreter: let it exit its own way
        sys.exit(status)
    shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; called without ``argv`` (the ``kiln`` command itself), it ends the process."""
    ns = build_parser().parse_args(argv)
    try:
        status = _dispatch(ns)
    except KilnError as exc:
        print(f"kiln {ns.command}: {exc}", file=sys.stderr)
        status = exc.exit_status
    if argv is None:  # the process is this command: callers in-process (tests) get the status back
        _exit_now(status)
    return status
