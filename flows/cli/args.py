"""What every command's parser shares: how a subcommand names its handler, and the flags several commands take."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from kiln.tasks.project.config import KilnConfig

# A subcommand's handler (``set_defaults``): a plain one gets the arguments; one that needs the project
# gets kiln.toml loaded too, once, by the dispatcher (kiln.flows.cli.entry).
PlainHandler = Callable[[argparse.Namespace], int]
ConfigHandler = Callable[[argparse.Namespace, KilnConfig], int]
# What a flow command does while Kiln's local server starts (kiln.flows.run.headstart), named by its function there.
HeadStart = str | None
# The subparsers of ``kiln``: each command group's module adds its commands to it.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def runs(parser: argparse.ArgumentParser, handler: PlainHandler) -> None:
    parser.set_defaults(handler=handler, config_handler=None, connect=False, head_start=None)


def runs_with_config(parser: argparse.ArgumentParser, handler: ConfigHandler, *, flow: bool = False,
                     head_start: HeadStart = None) -> None:
    """``handler`` gets the loaded kiln.toml; ``flow``: it runs a flow, connected, under the command's signals
    (and takes ``-v``); ``head_start``: the kiln.flows.run.headstart function it runs while Kiln's server starts."""
    parser.set_defaults(handler=None, config_handler=handler, connect=flow, head_start=head_start, verbose=False)
    if flow:
        parser.add_argument("-v", "--verbose", action="store_true",
                            help="a line per finished unit instead of the live bar, and the whole text summary "
                                 "instead of the one-screen ending")


class Renamed(argparse.Action):
    """A flag's old spelling, kept for a release: it sets what the new flag sets, and says to use the new one."""

    # kwargs: argparse.Action's own (help, metavar, ...), passed on as argparse types them (Any).
    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    # values: whatever argparse parsed for this flag (Any: its type is the flag's own).
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated and will be removed in the next release; "
              f"use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_config(parser: argparse.ArgumentParser, out_default: str | None = "out") -> None:
    parser.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    if out_default is not None:
        parser.add_argument("--out", default=out_default,
                            help=f"where local views of runs go: OUT/<run-id>/, OUT/latest (default: {out_default})")


def add_run(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--run", dest="run_id", metavar="ID", default=None,
                        help=f"{what} of this run (a run id, or 'latest': the newest run that built wheels)")
