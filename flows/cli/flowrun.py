"""Running one flow from the command line: connected to a server, its summary and UI link printed, its exit status."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.errors import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from prefect import Flow, State


# ``-v`` of the command being run (a context variable: the daemon runs several commands in one process).
_verbose: ContextVar[bool] = ContextVar("kiln_cli_verbose", default=False)


@contextlib.contextmanager
def verbosity(verbose: bool) -> Iterator[None]:
    """The command's ``-v`` for the block: every unit's line, and the whole text summary."""
    token = _verbose.set(verbose)
    try:
        yield
    finally:
        _verbose.reset(token)


def print_result(name: str, state: State[Any]) -> int:
    """A flow that answers with text: print its result, or how it ended; the exit status."""
    if state.is_completed():
        print(state.result(), end="")
        return EXIT_OK
    print(f"\n{name} ended {state.name}: {state.message}", file=sys.stderr)
    return EXIT_FAILED


def _view(out: str | None, state: State[Any], run_id: str | None) -> Path | None:
    """The local view of the run the flow worked on: OUT/<run-id> (``latest`` resolved by its link)."""
    if out is None:
        return None
    if run_id and run_id != "latest":
        return Path(out) / run_id
    if run_id == "latest":
        return Path(out) / "latest"
    return Path(out) / str(state.state_details.flow_run_id)


# params: the flow's own keyword parameters, whatever their types (Any: each flow has its own signature).
def run_flow(flow: Flow[..., Any], view_root: str | None, run_id: str | None = None, **params: Any) -> int:
    """Run ``flow``; print the summary of its run; map its final state to an exit status."""
    from prefect.utilities.urls import url_for

    from kiln.flows.report import progress
    from kiln.flows.report.summary import print_summary
    from kiln.flows.run.common import sync_state

    if run_id is not None:
        params["run_id"] = run_id
    verbose = _verbose.get()
    with progress.showing(progress.PlainReporter(sys.stderr) if verbose else progress.reporter_for(sys.stderr)):
        state = sync_state(flow(**params, return_state=True))
    view = _view(view_root, state, run_id)
    if view is not None:
        print_summary(view, full=verbose)
    link = url_for("flow-run", obj_id=state.state_details.flow_run_id)
    if link:
        print(f"\nRun in the Prefect UI: {link}")
        _print_ui_login(link)
    if state.is_completed():
        return EXIT_OK
    print(f"\n{flow.name} ended {state.name}: {state.message}", file=sys.stderr)
    return EXIT_FAILED


def _print_ui_login(link: str) -> None:
    """Say how to log in when the link is on Kiln's local server: its UI opens on a password prompt."""
    from prefect.settings import get_current_settings

    from kiln.flows.local.server import ui_login_for

    login = ui_login_for(Path(get_current_settings().home), link)
    if login:
        print(login)


def connect(meanwhile: Callable[[], object] = lambda: None) -> contextlib.AbstractContextManager[Any]:
    """Point Prefect at its server: ``PREFECT_API_URL`` (environment, profile, a test harness) when set,
    else Kiln's local server for this ``PREFECT_HOME``, started now if it is not running, with
    ``meanwhile`` run while it starts.

    Returns the settings to run the command's flow under. On Kiln's local server,
    flow-run heartbeats are off unless ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` is
    set: nothing there reads them (the lost-run automation is the scale-out
    server's), and each flow run's end waits up to a second for their thread.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    settings = get_current_settings()
    if settings.api.url:
        return contextlib.nullcontext()
    from prefect.context import refresh_global_settings_context

    from kiln.flows.local.server import client_env, ensure_server_while

    info = ensure_server_while(Path(settings.home), meanwhile)
    # The environment, not a settings context: subprocesses (build workers, test envs) inherit it.
    os.environ.update(client_env(Path(settings.home), info))  # PREFECT_API_URL and the server's auth string
    refresh_global_settings_context()
    if "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" in os.environ:
        return contextlib.nullcontext()
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
