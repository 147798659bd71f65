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
started (:mod:`kiln.flows.cancel`), a second one exits at once.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast, get_args

from kiln.flows.local.environment import apply_defaults

apply_defaults()  # before anything imports prefect

from kiln.core.errors import EXIT_FAILED, EXIT_OK, KilnError  # noqa: E402
from kiln.tasks.bench.results import MetricChoice  # noqa: E402
from kiln.tasks.project.config import BENCH_SIZES, CHANNELS, KilnConfig  # noqa: E402
from kiln.tasks.testing.jobs import ISOLATIONS  # noqa: E402

if TYPE_CHECKING:
    from prefect import Flow, State

    from kiln.release.fetch import StoreSettings

# A subcommand's handler (``set_defaults``): a plain one gets the arguments; one that needs the project
# gets kiln.toml loaded too, once, by ``_dispatch``.
PlainHandler = Callable[[argparse.Namespace], int]
ConfigHandler = Callable[[argparse.Namespace, KilnConfig], int]
# What a flow command does while Kiln's local server starts (kiln.flows.headstart), named by its function there.
HeadStart = str | None


def _runs(parser: argparse.ArgumentParser, handler: PlainHandler) -> None:
    parser.set_defaults(handler=handler, config_handler=None, connect=False, head_start=None)


def _runs_with_config(parser: argparse.ArgumentParser, handler: ConfigHandler, *, flow: bool = False,
                      head_start: HeadStart = None) -> None:
    """``handler`` gets the loaded kiln.toml; ``flow``: it runs a flow, connected, under the command's signals;
    ``head_start``: the kiln.flows.headstart function it runs while Kiln's server starts."""
    parser.set_defaults(handler=None, config_handler=handler, connect=flow, head_start=head_start)



class _Renamed(argparse.Action):
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


def _add_config(parser: argparse.ArgumentParser, out_default: str | None = "out") -> None:
    parser.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    if out_default is not None:
        parser.add_argument("--out", default=out_default,
                            help=f"where local views of runs go: OUT/<run-id>/, OUT/latest (default: {out_default})")


def _add_run(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--run", dest="run_id", metavar="ID", default=None,
                        help=f"{what} of this run (a run id, or 'latest': the newest run that built wheels)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="CI and release pipeline for GPU-kernel libraries, on Prefect."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="inspect a package's repository and write the kiln.toml that builds it",
                       description="Read the package's build files (never run them) and write its kiln.toml.",
                       epilog="exit status: 0 written; 1 written, but its build names native sources the tree does"
                       " not hold (every build would fail: the file's header and stderr name them); 2 nothing"
                       " written (the message says why). Values it had to assume are said on stderr. --check: 0 the"
                       " kiln.toml agrees with the build, 1 it does not (each line says the key to change).")
    p.add_argument("directory", nargs="?", default=".", help="the package's repository (default: here)")
    p.add_argument("--check", action="store_true", help="write nothing: say where the repository's kiln.toml"
                   " disagrees with what its build reads (exit status 1 where it does)")
    _runs(p, lambda ns: _init_check_command(ns.directory) if ns.check else _init_command(ns.directory))

    p = sub.add_parser("nightly", help="build, test, benchmark and publish the nightly")
    _add_config(p)
    p.add_argument("--full", action="store_true", help="run every test: none is carried from an earlier run "
                   "([testing.selection]); a full run also checks that selection missed no failure")
    _runs_with_config(p, _nightly_command, flow=True, head_start="nightly")

    p = sub.add_parser("release", help="the release flow: validate, build, test, bench, approve, publish, verify")
    _add_config(p)
    _runs_with_config(p, _release_command, flow=True, head_start="release")
    p.add_argument("--version", required=True, help="PEP 440 version to release")
    p.add_argument("--ref", default="HEAD", help="git ref being released")
    p.add_argument("--channel", default="release")
    p.add_argument("--dry-run", action="store_true", help="publish to a local staging copy and print the plan")
    p.add_argument("--yes", action="store_true",
                   help="approve here instead of pausing for approval in the Prefect UI (command line only)")
    p.add_argument("--allow-regressions", metavar="REASON",
                   help="publish despite benchmark regressions that would block; the reason is recorded")
    p.add_argument("--from-run", metavar="RUN",
                   help="promote this completed nightly's tested wheels under --version instead of building"
                        " (binaries unchanged, checked by hash; the release's record names the run)")

    p = sub.add_parser("build", help="build kernels and wheels for every variant")
    _add_config(p)
    _runs_with_config(p, _build_command, flow=True, head_start="build")
    p.add_argument("--version", help="version to build (default: the commit's nightly version, "
                                     "<base>.dev<commit time as YYYYMMDDHHMMSS>)")
    p.add_argument("--variant", action="append", dest="variants", help="only this variant (repeatable)")
    p.add_argument("--witness", action="store_true",
                   help="build every wheel again with every cache bypassed and fail unless each is byte-identical")

    p = sub.add_parser("test", help="run the test suites in isolated processes")
    _add_config(p)
    _runs_with_config(p, _test_command, flow=True)
    p.add_argument("--suite", action="append", dest="suites", help="only this suite (repeatable)")
    p.add_argument("--isolate", choices=ISOLATIONS, default="test")
    p.add_argument("--timeout", type=float, help="deadline per test in seconds (default: the suite's)")
    p.add_argument("--retries", type=int, default=1, help="retries of infrastructure failures")
    p.add_argument("--junit", help="also write JUnit XML here")
    p.add_argument("--json", dest="json_path", help="also write the JSON summary here")
    p.add_argument("--changed-since", help="run only suites whose dependencies changed since this git ref")
    p.add_argument("--full", action="store_true", help="run every test: none is carried from an earlier run "
                   "([testing.selection])")
    p.add_argument("--explain", action="store_true", help="run nothing: print, per test of each suite's newest "
                   "record, whether the next run runs or carries it and why (against the --run's wheels)")
    p.add_argument("--selection-on", metavar="SUITE", help="run nothing: turn test selection back on for SUITE "
                   "after a recall check turned it off")
    _add_run(p, "test the wheels")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="-- then test paths or node ids, run as one ad-hoc suite instead of the configured ones "
                        "(each test isolated as usual), and options for pytest (-k EXPR, -x)")

    p = sub.add_parser("bench", help="benchmark every kernel against its torch reference")
    _add_config(p, out_default=None)
    _runs_with_config(p, _bench_command, flow=True)
    p.add_argument("--run-dir", default="out", help="run directory (default: out)")
    p.add_argument("--results", dest="results_path", metavar="FILE", help="also write the results JSON here")
    p.add_argument("--out", dest="results_path", metavar="FILE", action=_Renamed, new="--results",
                   help="deprecated spelling of --results (every other command's --out is a folder)")
    p.add_argument("--compare", metavar="BASELINE", help="a results file, or 'last' for the previous stored run")
    p.add_argument("--size", choices=BENCH_SIZES)
    p.add_argument("--metric", choices=get_args(MetricChoice), default="auto")
    _add_run(p, "benchmark the wheel")

    p = sub.add_parser("publish", help="publish the run's wheels to an index")
    _add_config(p)
    _runs_with_config(p, _publish_command, flow=True)
    p.add_argument("--to", dest="target", help="publish target name from kiln.toml")
    p.add_argument("--channel", choices=CHANNELS, default="nightly")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--run", dest="run_id", metavar="ID", default="latest",
                   help="publish the wheels of this run (a run id, or 'latest', the default: the newest run "
                        "that built wheels)")

    p = sub.add_parser("prune", help="apply [publish.retention] to a nightly channel: yank older nightlies, "
                                     "remove them after the grace period")
    _add_config(p)
    _runs_with_config(p, _prune_command, flow=True)
    p.add_argument("--to", dest="target", help="publish target name from kiln.toml (default: the default target)")
    p.add_argument("--channel", choices=CHANNELS, default="nightly")
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")

    p = sub.add_parser("index", help="generate a PEP 503/691 index (no Prefect needed)")
    p.add_argument("wheel_dir", nargs="?", help="directory of wheels to index")
    p.add_argument("--from-list", help="JSON lines: filename, sha256, size, upload_time, ...")
    p.add_argument("--out", required=True, help="output directory (this user's alone, 0700, unless --public)")
    p.add_argument("--public", action="store_true",
                   help="the output is served to others on purpose (another user's web server): readable by all,"
                        " and an existing directory others own or may write into is accepted")
    _runs(p, _index_command)

    p = sub.add_parser("policies", help="write one least-privilege IAM policy per step")
    _add_config(p, out_default="policies")
    _runs_with_config(p, _policies_command)

    p = sub.add_parser("verify", help="check an index: links, hashes, sidecars; then install from it")
    p.add_argument("url", help="http(s):// (Kiln's server or any static server), file:///dir/ or s3://bucket/prefix/")
    p.add_argument("--no-install", action="store_true", help="only check links and hashes")
    p.add_argument("--extra-index-url", action="append", dest="extra_index_urls", default=[], metavar="URL",
                   help="resolve the package's dependencies from this index too (repeatable); fails when it "
                        "would win a name the index under test holds; without it the install uses --no-deps "
                        "(with the dependencies the index under test holds)")
    p.add_argument("--config", default="kiln.toml",
                   help="for s3:// URLs: the publish target settings (region, endpoint, owner) of that bucket")
    p.add_argument("--hint", action="append", dest="hints", default=[], metavar="'pip install ...'",
                   help="an install command a run printed: run it in a fresh venv, as a user would (each step "
                        "resolved first, not run when it would take a name this index holds from another index); "
                        "it must install the version this index publishes (repeatable)")
    _runs(p, _verify_command)
    p.add_argument("--public-url", metavar="URL",
                   help="the CDN or web server in front of this index (standing for URL): every page and file "
                        "is downloaded through it too and must have the bytes the index says (a stale cache fails)")

    _add_which(sub.add_parser("which", help="the install command of the wheel on an index that fits an environment "
                                            "(default: this one), or why none fits"))
    p = sub.add_parser("audit-abi", help="audit wheels' shared libraries: unstable torch symbols, the minimum torch, "
                                         "abi3 compliance of abi3-tagged wheels (exit 1: a wheel breaks its claim)")
    p.add_argument("wheels", nargs="+", metavar="WHEEL", help="a wheel file")
    p.add_argument("--stable", action="store_true",
                   help="the wheels claim the torch stable ABI (abi = \"stable\"): unstable torch symbols fail")
    _runs(p, lambda ns: _audit_abi_command(ns.wheels, ns.stable))

    _add_history(sub.add_parser("history", help="the benchmark history the nightlies stored, by commit"))
    _add_bisect(sub.add_parser("bisect", help="the first commit where a test fails or a benchmark got slower, "
                                              "from the wheels runs stored"))
    p = sub.add_parser("quarantine", help="the flaky tests in quarantine ([testing.quarantine]): they run and are "
                                          "reported, and do not gate publishing")
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    _runs_with_config(p, _quarantine_command)

    p = sub.add_parser("server", help="Kiln's local Prefect server (started by the first command that needs it)")
    p.add_argument("action", choices=("status", "start", "stop"))
    _runs(p, lambda ns: _server_command(ns.action))

    p = sub.add_parser("daemon", help="Kiln's build daemons (flow commands start one and reuse it; "
                                      "KILN_DAEMON=off turns them off)")
    p.add_argument("action", choices=("status", "stop"))
    _runs(p, _daemon_command)
    return parser


def _add_which(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the index: http(s)://, file:///dir/ or s3://bucket/prefix/")
    p.add_argument("--project", help="the project (default: the one the index holds besides kiln-runtime)")
    p.add_argument("--version", help="this version (default: the newest)")
    p.add_argument("--python", help="e.g. 3.12 (default: this interpreter)")
    p.add_argument("--platform", help="e.g. manylinux_2_28_x86_64 (default: this machine's)")
    p.add_argument("--torch", help="e.g. 2.14.1, or none (default: the installed torch's)")
    p.add_argument("--cuda", help="e.g. 13.0, or none (default: the installed torch's CUDA)")
    p.add_argument("--rocm", help="e.g. 6.4, or none (default: the installed torch's ROCm)")
    p.add_argument("--arch", help="GPU arch, e.g. 9.0 (default: the visible GPU's, if torch sees one)")
    p.add_argument("--extra-index-url", action="append", dest="extra_index_urls", default=[], metavar="URL",
                   help="where the dependencies the index does not hold come from (repeatable): the command then "
                        "has Kiln's two pip steps")
    _runs(p, _which_command)


def _add_history(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    p.add_argument("--kernel", help="only this kernel")
    p.add_argument("--case", help="only this case (e.g. n4096)")
    p.add_argument("--variant", help="the variant whose runs to show (default: the newest stored run's)")
    p.add_argument("--metric", choices=("graph_replay", "eager", "cpu"),
                   help="the decision metric (default: the newest stored run's)")
    p.add_argument("--limit", type=int, default=30, help="at most this many runs, the newest (default: 30)")
    p.add_argument("--plot", type=Path, help="also write the trend plot (PNG) here")
    _runs_with_config(p, _history_command)


def _add_bisect(p: argparse.ArgumentParser) -> None:
    p.add_argument("--good", required=True, help="a commit (any git ref) where the test passes")
    p.add_argument("--bad", required=True, help="a later commit where it fails")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--test", metavar="NODEID", help="the pytest node id, e.g. tests/test_x.py::test_y")
    mode.add_argument("--bench", metavar="KERNEL[/CASE]",
                      help="the benchmark: the first commit slower than --good beyond the threshold and the noise")
    p.add_argument("--variant", default="cpu", help="whose wheel to install (default: cpu)")
    p.add_argument("--config", default="kiln.toml", help="project description (default: kiln.toml)")
    _runs_with_config(p, _bisect_command, flow=True)


def _bisect_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.bisect import bisect_flow
    from kiln.flows.common import sync_state

    return _print_result("bisect", sync_state(bisect_flow(good=ns.good, bad=ns.bad, test=ns.test, bench=ns.bench,
                                                          config_path=ns.config, variant=ns.variant,
                                                          return_state=True)))


def _print_result(name: str, state: State[Any]) -> int:
    """A flow that answers with text: print its result, or how it ended; the exit status."""
    if state.is_completed():
        print(state.result(), end="")
        return EXIT_OK
    print(f"\n{name} ended {state.name}: {state.message}", file=sys.stderr)
    return EXIT_FAILED


def _pytest_args(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


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
def _run_flow(flow: Flow[..., Any], view_root: str | None, run_id: str | None = None, **params: Any) -> int:
    """Run ``flow``; print the summary of its run; map its final state to an exit status."""
    from prefect.utilities.urls import url_for

    from kiln.flows import progress
    from kiln.flows.common import sync_state
    from kiln.flows.summary import print_summary

    if run_id is not None:
        params["run_id"] = run_id
    with progress.showing(progress.reporter_for(sys.stderr)):
        state = sync_state(flow(**params, return_state=True))
    view = _view(view_root, state, run_id)
    if view is not None:
        print_summary(view)
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


def _connect(meanwhile: Callable[[], object] = lambda: None) -> contextlib.AbstractContextManager[Any]:
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


def _prune_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.common import sync_state
    from kiln.flows.prune import prune_flow

    return _print_result("prune", sync_state(prune_flow(config_path=ns.config, channel=ns.channel, target=ns.target,
                                                        dry_run=ns.dry_run, out=ns.out, return_state=True)))


def _store_settings(url: str, config_path: str) -> StoreSettings | None:
    """The publish target's settings for an ``s3://`` URL (None for other URLs, or without a kiln.toml)."""
    if not url.startswith("s3://") or not Path(config_path).exists():
        return None
    from kiln.tasks.project.config import load_config
    from kiln.tasks.releasing import store_settings_for

    return store_settings_for(load_config(config_path), url)


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


def _audit_abi_command(wheels: list[str], stable: bool) -> int:
    from kiln.tasks.build.abi_audit import audit_wheel

    audits = [audit_wheel(Path(wheel), torch_stable=stable) for wheel in wheels]
    for audit in audits:
        print("\n".join(audit.lines()))
    return EXIT_FAILED if any(audit.findings() for audit in audits) else EXIT_OK


def _index_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import index_command

    if bool(ns.wheel_dir) == bool(ns.from_list):
        raise SystemExit("kiln index: give exactly one of WHEEL_DIR or --from-list FILE")
    return index_command(ns.wheel_dir, ns.from_list, ns.out, ns.public)


def _verify_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import verify_command

    return verify_command(ns.url, install=not ns.no_install, extra_index_urls=ns.extra_index_urls,
                          settings=_store_settings(ns.url, ns.config), hints=ns.hints, public_url=ns.public_url)


def _which_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import which_command
    from kiln.release.whichenv import Asked

    asked = Asked(python=ns.python, platform=ns.platform, torch=ns.torch, cuda=ns.cuda, rocm=ns.rocm, arch=ns.arch)
    return which_command(ns.url, ns.project, ns.version, asked, ns.extra_index_urls)


def _daemon_command(ns: argparse.Namespace) -> int:
    from kiln.flows.local.daemon_server import daemon_command

    return daemon_command(ns.action)


def _policies_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.policies import write_policies

    return write_policies(config, ns.out)


def _history_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.history import show_history

    print(show_history(config, kernel=ns.kernel, case=ns.case, variant=ns.variant, metric=ns.metric,
                       limit=ns.limit, plot=ns.plot), end="")
    return EXIT_OK


def _quarantine_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.quarantine import show_quarantine

    print(show_quarantine(config), end="")
    return EXIT_OK


def _nightly_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.nightly import nightly_flow

    return _run_flow(nightly_flow, ns.out, config_path=ns.config, out=ns.out, full=ns.full)


def _release_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.release import approved_release_flow, release_flow

    # --yes picks the flow approved on the command line: the deployment's form has no such toggle.
    return _run_flow(
        approved_release_flow if ns.yes else release_flow, ns.out, version=ns.version, ref=ns.ref,
        channel=ns.channel, dry_run=ns.dry_run, allow_regressions=ns.allow_regressions, config_path=ns.config,
        out=ns.out, from_run=ns.from_run,
    )


def _build_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.build import build_flow

    return _run_flow(build_flow, ns.out, config_path=ns.config, out=ns.out, version=ns.version, variants=ns.variants,
                     witness=ns.witness)


def _test_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.params import SuiteOptions
    from kiln.flows.test import test_flow
    from kiln.tasks.testing.suite import split_test_args

    if ns.explain or ns.selection_on:
        from kiln.flows.selection import explain_selection, selection_on

        print(selection_on(config, ns.selection_on) if ns.selection_on
              else explain_selection(config, ns.suites, ns.run_id, ns.out, full=ns.full), end="")
        return EXIT_OK
    # `-- PATHS` run as one ad-hoc suite; options after `--` (-k, -x) go to pytest.
    paths, pytest_args = split_test_args(_pytest_args(ns.pytest_args), Path.cwd(), config.root)
    options = SuiteOptions(isolate=ns.isolate, timeout=ns.timeout, retries=ns.retries, pytest_args=pytest_args,
                           junit=ns.junit, json_path=ns.json_path, full=ns.full)
    return _run_flow(test_flow, ns.out, config_path=ns.config, out=ns.out, suites=ns.suites, options=options,
                     changed_since=ns.changed_since, paths=paths or None, run_id=ns.run_id)


def _bench_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.bench import bench_flow

    return _run_flow(
        bench_flow, ns.run_dir, config_path=ns.config, out=ns.run_dir, compare=ns.compare, size=ns.size,
        metric=ns.metric, results_path=ns.results_path, run_id=ns.run_id,
    )


def _publish_command(ns: argparse.Namespace, config: KilnConfig) -> int:
    from kiln.flows.publish import publish_flow

    return _run_flow(publish_flow, ns.out, config_path=ns.config, out=ns.out, target=ns.target,
                     channel=ns.channel, dry_run=ns.dry_run, run_id=ns.run_id)


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
    from kiln.flows import cancel

    # From here one SIGTERM or Ctrl-C cancels the command: its flow run ends Cancelled, what it started ends.
    with cancel.command_signals():
        return cancel.cancelled_status(ns.command, lambda: _connected(handler, ns, config))


def _connected(handler: ConfigHandler, ns: argparse.Namespace, config: KilnConfig) -> int:
    with _connect(lambda: _head_start(ns, config)):
        return handler(ns, config)


def _head_start(ns: argparse.Namespace, config: KilnConfig) -> None:
    if ns.head_start is not None:
        from kiln.flows import headstart

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


if __name__ == "__main__":
    sys.exit(main())
