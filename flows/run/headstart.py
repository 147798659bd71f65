"""What a flow command does while Kiln's local Prefect server starts (a first run waits seconds for it).

A command that finds no server waits for one: a first start creates Prefect's
database, about 11 s on two cores, with one core mostly idle. The work here is
what the command's flow would do first anyway and needs no server, so it fills
that wait (:func:`kiln.flows.local.server.ensure_server_while`): importing the
flow's modules, starting to copy the test bases the test stage takes from this
interpreter, starting the build's compile workers and starting the sandboxed guest that reads the project's
kernel registry (torch, Triton) for the build's plan: the package's code is never imported in this process.
Nothing here starts a flow run, writes a run record or changes what the flow then does; an error here is the
flow's to meet again.
"""

from __future__ import annotations

import argparse
import importlib

from kiln.tasks.build.stage import head_start as build_head_start
from kiln.tasks.project.config import KilnConfig


def nightly(ns: argparse.Namespace, config: KilnConfig) -> None:
    from kiln.flows.nightly import prepare_test_bases  # imports the flow's modules

    prepare_test_bases(config)
    build_head_start(config)


def build(ns: argparse.Namespace, config: KilnConfig) -> None:
    importlib.import_module("kiln.flows.build")
    build_head_start(config)


def release(ns: argparse.Namespace, config: KilnConfig) -> None:
    importlib.import_module("kiln.flows.release")
    if getattr(ns, "from_run", None) is None:  # a promotion builds nothing
        build_head_start(config)
