"""The commands about Kiln's own processes on this machine: its local Prefect server and its build daemons."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.core.errors import EXIT_FAILED, EXIT_OK
from kiln.flows.cli.args import Commands, runs


def add_server(sub: Commands) -> None:
    p = sub.add_parser("server", help="Kiln's local Prefect server (started by the first command that needs it)")
    p.add_argument("action", choices=("status", "start", "stop"))
    runs(p, lambda ns: _server_command(ns.action))


def add_daemon(sub: Commands) -> None:
    p = sub.add_parser("daemon", help="Kiln's build daemons (flow commands start one and reuse it; "
                                      "KILN_DAEMON=off turns them off)")
    p.add_argument("action", choices=("status", "stop"))
    runs(p, _daemon_command)


def _server_command(action: str) -> int:
    from prefect.settings import get_current_settings

    from kiln.flows.local import server
    from kiln.flows.local.server_watch import list_servers

    home = Path(get_current_settings().home)
    if action == "start":
        started = server.ensure_server(home)
        print(f"Prefect server running: pid {started.pid}, API {started.api_url}, UI {started.ui_url}, "
              f"log {started.log}")
        print(server.ui_login(home))
        return EXIT_OK
    if action == "stop":
        stopped = server.stop_server(home)
        print(f"stopped the Prefect server pid {stopped.pid} ({stopped.api_url})" if stopped
              else f"no Kiln Prefect server is running for {home}")
        return EXIT_OK
    info, word = server.server_status(home)
    if info is None:
        print(f"no Kiln Prefect server for {home} (the next command that runs a flow starts one)")
    else:
        print(f"{word}: pid {info.pid}, API {info.api_url}, UI {info.ui_url}, Prefect {info.prefect_version}, "
              f"log {info.log}")
        print(server.ui_login(home))
    watched = list_servers()
    print(f"Kiln Prefect servers of this user: {len(watched)}")
    for w in watched:
        state = "this home" if w.home == home else "home exists" if w.home.is_dir() else "home gone"
        print(f"  watchdog pid {w.pid}  port {w.port}  home {w.home}  ({state})")
    return EXIT_OK if word == "running" else EXIT_FAILED


def _daemon_command(ns: argparse.Namespace) -> int:
    from kiln.flows.local.daemon_server import daemon_command

    return daemon_command(ns.action)
