"""The ``kiln`` command line.

Each stage command runs its own Prefect flow; ``kiln index``, ``kiln verify``
and ``kiln policies`` need no Prefect server. Configuration is loaded and
validated before any flow starts, so a bad ``kiln.toml`` starts nothing.
A flow talks to the server ``PREFECT_API_URL`` names; without one, to Kiln's
local server for this machine (:mod:`kiln.flows.local.server`, started on first
use), and the command ends with the link to its run in the UI.
Exit status: 0 when the flow completed, 1 when it ended Failed, 2 on bad
input, 128 + the signal when SIGTERM (143) or Ctrl-C (130) cancelled it: the
first signal ends the flow run Cancelled and every process the command
started (:mod:`kiln.flows.run.cancel`), a second one exits at once.

One module per command group: ``stages`` (the flow commands), ``indexes``
(index, verify, which, audit-abi), ``project`` (init, policies, history,
quarantine), ``local`` (server, daemon); ``args`` holds what their parsers
share, ``flowrun`` runs a flow for a command, ``parser`` puts the commands
together and ``entry`` dispatches them.
"""

from __future__ import annotations

from kiln.flows.local.environment import apply_defaults

apply_defaults()  # before anything imports prefect

from kiln.flows.cli.entry import main  # noqa: E402
from kiln.flows.cli.parser import build_parser  # noqa: E402

__all__ = ["build_parser", "main"]
